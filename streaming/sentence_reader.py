"""Reading a sentence's units (`read_sentence`), here or in a process of its own (`ProcessReader`).

Why a process: reading a sentence (normalising its words, espeak-ng, aligning the units with the words) costs
~0.5 ms a word on 2 cores (`bench/results/agent_host_cpu/NOTES.md`), all of it holding the interpreter lock
(Piper's espeak binding keeps the lock while it phonemises), and an agent-like load reads a sentence again at
every word it receives. In a server process that lock is also what the engine thread needs between each of its
torch calls, so the text thread's reading stretches the engine's ticks. `ProcessReader` runs `read_sentence` in a
child interpreter (`python -m streaming.sentence_reader`): the text thread pickles the sentence's tokens (tens of
microseconds), then waits on a pipe without the lock. Same code, same espeak data: the same units.

This module imports neither torch nor the engine, so the child starts in a fraction of a second.
"""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
import threading
import warnings

from tts.normalize import Token, speak
from tts.text import sentence_units

_TO_COME = Token("people", 0, 0)  # never taken: its index is past every ready token


def read_sentence(tokens: list[Token], first: int, closed: bool) -> tuple[list[str], list[int]]:
    """A sentence's units from token ``first`` on (the tokens before it are context for the spoken forms) and,
    per unit, the index of its token in ``tokens`` (-1: none); the sentence ends after the last token if
    ``closed``. A pure function of its arguments: a `ProcessReader`'s child runs it as well."""
    spoken = speak(tokens, closed)
    window, said = tokens[first:], spoken[first:]
    if not closed:  # a word for those still to come: the last word read is not read as the clause's end
        window, said = window + [_TO_COME], said + [_TO_COME.text]
    units, owners = sentence_units(window, said, closed)
    return units, [o + first if o >= 0 else -1 for o in owners]


class ProcessReader:
    """`read_sentence` in a child process (one per engine: its text thread is the one caller). Called as
    ``reader(tokens, first, closed)``, like `read_sentence`. The child starts in the background; until it has
    answered its first call, and for good once it has failed (it exited, the pipe broke), sentences are read
    here, with a warning the first time. The front end's own errors (a `TextError`) come back and are raised."""

    def __init__(self):
        self._lock = threading.Lock()
        self._child: subprocess.Popen | None = None
        self._failed = False
        self._ready = threading.Event()
        threading.Thread(target=self._start, name="tts-text-reader-start", daemon=True).start()

    def _start(self) -> None:
        try:
            environment = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
            child = subprocess.Popen(
                [sys.executable, "-m", "streaming.sentence_reader"],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                env=environment,
            )
            pickle.dump(None, child.stdin)  # a first call: the child has imported and phonemised once
            child.stdin.flush()
            if pickle.load(child.stdout) != "ready":
                raise RuntimeError("the reader process did not start")
            with self._lock:
                if self._failed:  # closed meanwhile
                    child.stdin.close()
                    return
                self._child = child
        except Exception as err:  # no child: read here
            self._fail(err)
        finally:
            self._ready.set()

    def __call__(self, tokens: list[Token], first: int, closed: bool) -> tuple[list[str], list[int]]:
        with self._lock:
            child = self._child
            if child is not None:
                try:
                    pickle.dump((tokens, first, closed), child.stdin, protocol=pickle.HIGHEST_PROTOCOL)
                    child.stdin.flush()
                    answer = pickle.load(child.stdout)  # waits without the interpreter lock
                except Exception as err:
                    self._child = None
                    self._fail(err)
                else:
                    if isinstance(answer, BaseException):
                        raise answer
                    return answer
        return read_sentence(tokens, first, closed)

    def _fail(self, err: Exception) -> None:
        if not self._failed:
            self._failed = True
            warnings.warn(f"the text reader process is not available, reading in the engine's process: {err}")

    def close(self) -> None:
        with self._lock:
            child, self._child, self._failed = self._child, None, True
        if child is not None:
            child.stdin.close()  # the child ends at the end of its input
            try:
                child.wait(timeout=2)
            except subprocess.TimeoutExpired:
                child.kill()


def _serve(stdin, stdout) -> None:
    """The child: answer each pickled call with `read_sentence`'s result (or the error it raised) until the
    end of its input; None asks for "ready" (once espeak has been set up)."""
    while True:
        try:
            call = pickle.load(stdin)
        except EOFError:
            return
        if call is None:
            read_sentence([Token("ready", 0, 5)], 0, True)
            answer = "ready"
        else:
            try:
                answer = read_sentence(*call)
            except Exception as err:
                answer = err
        pickle.dump(answer, stdout, protocol=pickle.HIGHEST_PROTOCOL)
        stdout.flush()


if __name__ == "__main__":
    answers = os.fdopen(os.dup(1), "wb")  # the pipe to the parent; anything a library prints goes to stderr
    os.dup2(2, 1)
    _serve(sys.stdin.buffer, answers)
