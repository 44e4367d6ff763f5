"""What the engine's parts share: the state `Engine.__init__` builds (its one home is the engine object) and the
calls one part makes on another. `Events`, `Prefill`, `ParkingPolicy` and `TickRunner` derive from it, so each
part says in one place, typed, what it may touch; `Engine` puts them together."""

from __future__ import annotations

import threading
from collections import OrderedDict, deque
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:  # types only: the parts import this module, never the engine
    from streaming.codec_path import CodecPath
    from streaming.device_io import HostToDevice
    from streaming.device_updates import DeviceUpdates, HostFlags
    from streaming.live_figures import Recent
    from streaming.parking import Parked, ParkingConfig, ParkingStore
    from streaming.reservations import Reservations
    from streaming.sentence_reader import ProcessReader
    from streaming.slot_mover import SlotMover
    from streaming.slot_table import SlotTable, Utterance
    from streaming.slots import Slots
    from streaming.step_caches import StepCaches, TickGraph
    from streaming.stream import Stream
    from streaming.text_worker import TextWorker
    from tts.codec import Codec
    from tts.model import ModelConfig, TTSModel


class EngineState:
    """The engine's state, by owner: the model side, the slots and caches, the codec path, the slot table, the
    parking store and mover, the event hand-offs, and the figures."""

    # the model side
    model: TTSModel
    codec: Codec
    cfg: ModelConfig
    device: torch.device
    sampling: Any  # `SamplingConfig`
    speculative: bool
    frame_codec: bool
    max_streams: int
    prefixes: tuple[torch.Tensor, torch.Tensor]
    _blend_prefixes: OrderedDict
    # slots, caches, the codec path and the host's view of them
    slots: Slots
    caches: StepCaches
    codec_path: CodecPath
    io: HostToDevice
    table: SlotTable
    _flags: HostFlags
    _spoken_speculative: torch.Tensor
    # parking
    parking: ParkingConfig
    store: ParkingStore
    mover: SlotMover
    _parking: list[Utterance]
    # threads and hand-offs
    admission: Reservations
    text_worker: TextWorker
    text_reader: ProcessReader | None
    _lock: threading.Lock
    _inbox: deque
    _handlers: dict[str, Callable]
    _todo: DeviceUpdates
    _schedules: list
    _inflight: deque
    _unstepped: list[Utterance]
    _ticks: int
    _any_ready: bool
    _waited: float
    # steps
    _factory: Any
    _next_factory: Any
    _steps: dict[int, Callable]
    _views: dict[int, StepCaches]
    _graphs: dict[int, TickGraph] | None
    step_kind: str
    # figures
    counters: dict[str, int]
    step_ms: Recent
    slot_wait_ms: Recent

    # ---- calls between the parts (each defined in the part named) ----------------------------------------
    def wake(self) -> None:  # Engine
        raise NotImplementedError

    def text_arrived(self, stream: Stream) -> None:  # Engine
        raise NotImplementedError

    def voice_preset(self, voice: str) -> dict:  # Engine
        raise NotImplementedError

    @property
    def fingerprint(self) -> str:  # ParkingPolicy
        raise NotImplementedError

    def _fail(self, stream: Stream, error: Exception) -> None:  # Events
        raise NotImplementedError

    def _end(self, stream: Stream, error: Exception | None) -> None:  # Events
        raise NotImplementedError

    def _drop(self, u: Utterance) -> None:  # Events
        raise NotImplementedError

    def _vacate(self, u: Utterance) -> None:  # Events
        raise NotImplementedError

    def _wait_for_slot(self, u: Utterance, why: str) -> None:  # Events
        raise NotImplementedError

    def _choose_prefill(self) -> list[tuple[Utterance, int]]:  # Prefill
        raise NotImplementedError

    def _prefill(self, chosen: list[tuple[Utterance, int]]) -> None:  # Prefill
        raise NotImplementedError

    def _start_caches(self, rows: torch.Tensor, utterances: list[Utterance]) -> None:  # Prefill
        raise NotImplementedError

    def _choose_parks(self) -> None:  # ParkingPolicy
        raise NotImplementedError

    def _park_rows(self, parks: list[tuple[Utterance, int]]) -> None:  # ParkingPolicy
        raise NotImplementedError

    def _restore_rows(self, restores: list[tuple[Utterance, Parked]]) -> list[int]:  # ParkingPolicy
        raise NotImplementedError

    def _park_soon(self, u: Utterance) -> None:  # ParkingPolicy
        raise NotImplementedError

    def _continue_parks(self) -> None:  # ParkingPolicy
        raise NotImplementedError

    def _end_lost(self) -> None:  # ParkingPolicy
        raise NotImplementedError

    def _start_detach(self, u: Utterance) -> None:  # ParkingPolicy
        raise NotImplementedError

    def _tick_graphs(self) -> dict | None:  # TickRunner
        raise NotImplementedError

    def _graph_for(self, n: int) -> TickGraph | None:  # TickRunner
        raise NotImplementedError

    def _step_for(self, n: int) -> Callable:  # TickRunner
        raise NotImplementedError
