"""Two CUDA graphs of float32 matmuls replayed at once on two streams: are their results those of one replay at
a time? Each pair captured twice: both on torch.cuda.graph's default capture stream (which shares one cuBLAS
workspace between the graphs), then the second on a stream of its own. Prints mismatching replays per case.
    python3 scripts/gpu/workspace_race.py
"""

import torch


def capture(fn, stream=None):
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()  # cuBLAS initialised outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        out = fn()
    return graph, out


def trial(m: int, k: int, n: int, own_stream: bool, replays: int = 2000) -> int:
    a, b, c, d = (torch.randn(*shape, device="cuda") for shape in ((m, k), (k, n), (m, k), (k, n)))
    g1, o1 = capture(lambda: a @ b)
    g2, o2 = capture(lambda: c @ d, torch.cuda.Stream() if own_stream else None)
    g1.replay()
    g2.replay()
    torch.cuda.synchronize()
    r1, r2 = o1.clone(), o2.clone()  # one at a time
    s1, s2 = torch.cuda.Stream(), torch.cuda.Stream()
    bad = torch.zeros((), dtype=torch.long, device="cuda")
    bad1, bad2 = bad.clone(), bad.clone()
    main = torch.cuda.current_stream()
    for _ in range(replays):
        s1.wait_stream(main)
        s2.wait_stream(main)
        with torch.cuda.stream(s1):
            g1.replay()
            bad1 += (o1 != r1).any()
        with torch.cuda.stream(s2):
            g2.replay()
            bad2 += (o2 != r2).any()
        main.wait_stream(s1)
        main.wait_stream(s2)
    torch.cuda.synchronize()
    return int(bad1) + int(bad2)


def main():
    torch.manual_seed(0)
    print("torch", torch.__version__, torch.cuda.get_device_name())
    for m, k, n in ((64, 8192, 512), (16, 16384, 256), (256, 1024, 1024), (64, 512, 3072)):
        shared, own = trial(m, k, n, False), trial(m, k, n, True)
        print(
            f"({m}x{k}) @ ({k}x{n}), 2 x 2000 replays at once: mismatching replays, one capture stream {shared}, "
            f"own capture streams {own}"
        )


if __name__ == "__main__":
    main()
