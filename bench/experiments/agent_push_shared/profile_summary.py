"""Summarise a py-spy raw profile of `bench.agent` by thread role (the server's event loop, its tts-io pool, the
engine's threads): GIL samples per role, then, for the roles named, the functions matching a pattern by
inclusive samples and the leaf functions by self samples.

    py-spy record --gil --threads -r 100 -f raw -o run.raw -- python -m bench.agent --tiny --clients 128 --slots 16 --minutes 0.5
    python bench/results/agent_push_shared/profile_summary.py run.raw loop,pool "server.py|hub.py|stream.py"
"""
import collections
import re
import sys


def role(frames: list[str]) -> str:
    stack = ";".join(frames)
    if stack.startswith("_run_module_as_main"):
        return "main"
    if "_worker (concurrent/futures/thread.py" in stack:
        return "pool"
    if "Server.run (uvicorn" in stack:
        return "loop"
    for name, mark in (("probe", "_probe"), ("codec", "codec_worker"), ("text", "text_worker"),
                       ("engine", "engine.py")):
        if mark in stack:
            return name
    return "other"


def main(path: str, roles: str, pattern: str = "") -> None:
    by_role, inclusive = collections.Counter(), collections.defaultdict(collections.Counter)
    leaf = collections.defaultdict(collections.Counter)
    for line in open(path):
        stack, _, count = line.rstrip().rpartition(" ")
        frames, n = stack.split(";")[1:], int(count)  # the first frame names the thread
        name = role(frames)
        by_role[name] += n
        functions = [re.sub(r" \((.*):\d+\)", r" (\1)", frame) for frame in frames]
        for function in set(functions):
            inclusive[name][function] += n
        leaf[name][functions[-1] if functions else "?"] += n
    total = sum(by_role.values())
    print("samples", total, {name: f"{n} {100 * n / total:.1f}%" for name, n in by_role.most_common()})
    wanted = re.compile(pattern)
    for name in roles.split(","):
        print("== inclusive", name, by_role[name])
        for function, n in inclusive[name].most_common(200):
            if wanted.search(function):
                print(f"{n:6d} {100 * n / by_role[name]:5.1f}% {function}")
        print("== leaf", name)
        for function, n in leaf[name].most_common(25):
            print(f"{n:6d} {100 * n / by_role[name]:5.1f}% {function}")


if __name__ == "__main__":
    main(*sys.argv[1:])
