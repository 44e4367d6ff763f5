"""When a slot's state moves: parking stalled and held streams (their slot goes to the next stream waiting),
restoring them, and moving a stream to another engine (`detach`/`attach`) or copying it (`snapshot`). The copies
themselves are `SlotMover`'s; the store, `streaming.parking`. A mixin of `Engine` (its public `detach`,
`attach`, `snapshot`; the rest on the engine thread)."""

from __future__ import annotations

import time
from typing import cast

import numpy as np

from streaming.engine_state import EngineState
from streaming.errors import BadState, EngineError, ParkedStateLost, ServerFull
from streaming.parking import Parked, pack, unpack, weights_fingerprint
from streaming.reservations import Full
from streaming.slot_mover import DetachRequest, Snapshot, host_state
from streaming.slot_table import Utterance
from streaming.stream import EngineInbox, Stream


class ParkingPolicy(EngineState):
    """`Engine`'s parking, restoring and moving of streams."""

    _fingerprint: str | None = None

    def detach(self, stream: Stream, timeout: float = 30.0) -> bytes:
        """Park ``stream`` at once and remove it from this engine; its reader here gets no more audio
        (``stream.moved``, `Stream.read` returns None). Returns its whole state (slot state, text front end,
        unread audio, voice, speed, seed, counters) for `attach` on an engine with the same weights, where it
        continues sample-exactly. Raises EngineError if the stream is not open here (or ends meanwhile)."""
        if stream.engine is not self or stream.finished or stream.cancelled or stream.moved:
            raise EngineError("only a stream open on this engine can be detached")
        request = DetachRequest()
        stream.detach_request = request
        stream.detaching = True  # the text thread takes no more text: what it took reaches the engine first
        self.text_arrived(stream)  # and then tells the engine (`_on_text`), in order
        if not request.done.wait(timeout):
            raise EngineError(f"the stream could not be detached within {timeout:g} s")
        if request.error is not None:
            raise request.error
        u = request.utterance
        try:
            if u.parked is not None and not u.parked.settled(timeout):  # the CPU codec worker adds the decoder's rows
                raise EngineError("the stream's decoder state was not captured in time")
            rows = {} if u.parked is None else u.parked.rows
            return pack(self._host_state(u), rows, stream.take_unread(), self.fingerprint)
        finally:
            if u.parked is not None:
                u.parked.release()  # packed (copied), or given up: its pool row goes back

    def attach(self, state: bytes, wait_s: float = 0.0) -> Stream:
        """Continue a stream detached from another engine with the same weights (`detach`): a new Stream that
        first yields the audio its old reader had not read, then goes on where it stopped. Admission as in
        `open`. Raises BadState for bytes that are not such a state, UnknownVoice, ServerFull."""
        try:
            host, rows, unread = unpack(state, self.fingerprint)
        except ValueError as err:
            raise BadState(str(err)) from None
        if rows and host["frame_codec"] != self.frame_codec:
            raise BadState("the stream was detached from an engine with the other codec path (frame codec on/off)")
        if rows and not set(self.mover.row_tensors()) <= set(rows):
            raise BadState("the stream's state lacks rows this engine needs (an engine of another version?)")
        stream = Stream.from_state(cast(EngineInbox, self), host["stream"], unread)
        if self.text_reader is not None:
            stream.text.reader = self.text_reader
        preset = self.voice_preset(stream.voice)
        try:
            self.admission.admit(stream, wait_s, lambda s: self._inbox.append(("attach", s, (preset, host, rows))))
        except Full as err:
            raise ServerFull(str(err)) from None
        self.wake()
        self.text_arrived(stream)  # text it had not yet taken
        return stream

    @property
    def fingerprint(self) -> str:
        """A digest of the model's and the codec's weights and configs: a moved stream needs the same."""
        if self._fingerprint is None:
            self._fingerprint = weights_fingerprint(self.model, self.codec)
        return self._fingerprint

    def _host_state(self, u: Utterance) -> dict:
        """``u``'s host state for `detach` and `snapshot` (`slot_state.host_state`); its counts from the slot's
        tables while it holds one."""
        return host_state(u, self.table.counts_of(u), self.frame_codec)

    def snapshot(self, stream: Stream, timeout: float = 10.0) -> tuple[bytes, int]:
        """A copy of ``stream``'s whole state, as `detach` returns it, while the stream goes on here; and how many
        samples of its audio come before that state. `attach` on an engine with the same weights continues the
        stream sample-exactly from that sample on (the audio before it is not in the copy). For checkpoints of
        live streams (serving/failover.py). The copy is consistent: the text thread stops at the stream's place
        in its queue (every unit it took before has reached the engine, none is taken after) while the engine
        thread, between two ticks, copies the host state and the slot's rows; the codec thread adds the decoder's
        rows after the chunks already due (their samples are the count). The caller pushes no text meanwhile.
        The CPU codec path only. Raises EngineError for a stream not open here, or parked or moving now (the
        caller may try again later), or on a frame codec."""
        if not self.codec_path.snapshots:
            raise EngineError("a snapshot needs the CPU codec path (no frame codec)")
        if stream.engine is not self or stream.finished or stream.cancelled or stream.moved or stream.detaching:
            raise EngineError("only a stream open on this engine can be snapshotted")
        taking = Snapshot(stream)

        def pause() -> None:  # on the text thread, in the stream's place: it waits there for the copy
            self._inbox.append(("snapshot", stream, taking))
            self.wake()
            taking.copied.wait(timeout)

        self._handlers.setdefault("snapshot", self._on_snapshot)
        self.text_worker.run_in_turn(pause)
        if not taking.done.wait(timeout):
            raise EngineError(f"no snapshot of the stream within {timeout:g} s")
        if taking.error is not None:
            raise taking.error
        return pack(taking.host, taking.rows, [], self.fingerprint), taking.samples

    def _on_snapshot(self, stream: Stream, taking: Snapshot) -> None:
        """`snapshot`'s copy, on the engine thread at its next events (never raises: it would fail the stream)."""
        try:
            u = self.table.by_stream.get(stream)
            if u is None or u.parked is not None or u.detach is not None:
                raise EngineError("the stream is parked, moving or gone: no snapshot now")
            taking.host = self._host_state(u)
            if u.slot < 0:  # waiting for its first slot: nothing spoken, no rows
                taking.samples = stream.samples
                taking.done.set()
            else:
                self.mover.copy_row(u.slot, taking.finish)
        except Exception as err:
            taking.fail(err)
        finally:
            taking.copied.set()

    def _choose_parks(self) -> None:
        """Park the slots stalled for ``park_after_s``. Such a slot did nothing in the tick in flight either
        (`_stalled_since`), so its state is complete on the device when this tick's updates copy it out.
        Example, park_after_s 0.5: slot 3's text runs dry; the first tick launched after its last event in which
        it cannot step was launched at t = 10.00 s, so its stalled_since is 10.00 (later such ticks keep the
        minimum); the first tick handled after 10.50 parks it. Had text come at 10.30, that event would have
        reset it to infinity, and the next tick launched after 10.30 in which it cannot step would set it anew."""
        cutoff = time.perf_counter() - self.parking.park_after_s
        stalled = np.flatnonzero(self.table.live & (self.table.stalled_since <= cutoff))
        for slot in stalled:
            self._park(cast(Utterance, self.table.utterances[slot]))  # a live slot has one

    def _park(self, u: Utterance) -> None:
        self.table.save_counts(u)
        u.parked, u.parked_paused, u.news = Parked(), u.stream.paused, False
        if u.parked_paused:  # restore once the reader has half the queue to play, not at the first read
            u.stream.resume_samples = u.stream.max_queued_samples // 2
        self._todo.parks.append((u, u.slot))
        self._vacate(u)
        self.counters["parks"] += 1

    def _park_rows(self, parks: list[tuple[Utterance, int]]) -> None:
        """Copy the parked slots' state out (`SlotMover.park`); hand the detached ones over."""
        self.mover.park([(cast(Parked, u.parked), slot) for u, slot in parks])  # set by `_park`
        for u, _ in parks:
            if u.detach is not None:
                self._finish_detach(u)

    def _restore_rows(self, restores: list[tuple[Utterance, Parked]]) -> list[int]:
        """Put parked states into their new slots (`SlotMover.restore`); returns the slots."""
        rows = [u.slot for u, _ in restores]
        self.mover.restore(rows, [p for _, p in restores])
        self.codec_path.restored(rows)  # (a frame codec's restored decoder state stands)
        return rows

    def _end_lost(self) -> None:
        """End the streams whose parked state could not be read back from disk (`ParkingStore.lost`)."""
        for parked in self.store.lost():
            u = next((u for u in self.table.by_stream.values() if u.parked is parked), None)
            if u is not None:
                self._fail(
                    u.stream,
                    ParkedStateLost(f"the stream's parked state could not be read back from disk: {parked.error}"),
                )

    def _park_soon(self, u: Utterance) -> None:
        """Park ``u``'s slot in this tick's updates; if the tick in flight may be stepping it (the frame codec),
        pause it now and park it once that tick is collected (`_continue_parks`)."""
        if not (self.codec_path.overlaps and self._inflight):
            self._park(u)
        elif u not in self._parking:
            self._todo.paused.append((u, True))
            u.park_after = self._ticks
            self._parking.append(u)

    def _continue_parks(self) -> None:
        waiting, self._parking = self._parking, []
        for u in waiting:
            if self.table.by_stream.get(u.stream) is not u:  # ended meanwhile
                if u.detach is not None:
                    u.detach.fail(EngineError("the stream ended before it could be detached"))
                continue
            if u.slot >= 0 and any(tick.serial < u.park_after for tick in self._inflight):
                self._parking.append(u)
            elif u.slot >= 0:
                self._park(u)
            elif u.detach is None:
                continue  # a hold, parked
            elif self.store.want(cast(Parked, u.parked)):
                self._finish_detach(u)
            else:
                self._parking.append(u)

    def _start_detach(self, u: Utterance) -> None:
        u.detach = u.stream.detach_request
        if u.slot >= 0:
            self._park_soon(u)  # finished in that tick's `_park_rows`
        elif u.parked is not None and not self.store.want(u.parked):
            self._parking.append(u)  # its state is on its way back from disk
        else:
            self._finish_detach(u)

    def _finish_detach(self, u: Utterance) -> None:
        """Hand the detached stream to `detach` (which reads its parked rows) and forget it here."""
        request, u.detach = cast(DetachRequest, u.detach), None
        parked = u.parked
        if parked is not None:
            self.store.take(parked)
        self._drop(u)
        u.parked = parked  # the CPU codec worker may still be adding the decoder's rows: `detach` waits for them
        request.utterance = u
        request.done.set()
