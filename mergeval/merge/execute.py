"""Run a plan: read one unit's tensors from every input, merge them, hand the results on, forget them.

The executor is shared by the in-memory merge and the streaming merge, so both
produce the same tensors bit for bit. At any time it holds one unit's inputs
(the base's and each expert's tensors for one tensor or one layer) and outputs,
which bounds memory by the largest unit times the number of inputs, whatever
the model's size. Each unit gets its own draws keyed by (run seed, unit key)
(methods/draws.py: counter-based, a pure function of the entry's index), so
random methods are reproducible and independent of unit order, row blocks,
threads and device.

On another device (``merge.device=cuda``: ``Device``) each unit's inputs, or each row block's, are read on the
CPU, moved to the device, merged there by the methods' torch definitions (the compiled kernels run on the CPU
only; the draws too are computed there, with the CPU's bits), and the result comes back to the CPU; one unit or
block is on the device at a time, so its memory is bounded by the largest unit, not the model.
"""

from __future__ import annotations

import math
import os
import threading
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager

import torch
from tqdm.auto import tqdm

from mergeval.merge.plan import Unit
from mergeval.merge.reader import CheckpointReader
from mergeval.merge.vocab import align
from mergeval.methods import MergeMethod, fused

# merging threads, one per core (at least 2, so reading overlaps merging; at most 8: memory grows with
# the units in flight)
WORKERS = max(2, min(8, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 2))
WINDOW = WORKERS  # units (or row blocks) read and merged ahead of the consumer: memory about WINDOW + 1 units,
# plus, while a large unit runs, the finished smaller ones behind it (at most its size: ``ordered``)
# tensors of at least BLOCK_MIN entries are merged in row blocks of about BLOCK_ENTRIES where the method allows.
# 256K (1 MiB of float32 per working copy): small enough that the blocks in flight keep the peak memory well
# below larger blocks' (4M / 1M), large enough to cost no speed; the bits are the same whatever the block size
BLOCK_MIN = 1 << 18
BLOCK_ENTRIES = 1 << 18
THREAD_NAME = "mergeval-merge"  # the workers' name prefix, by which ``abandoned_units`` finds them


def abandoned_units() -> bool:
    """Whether a merge stopped early (an error, an interruption) left worker threads finishing units whose
    results nobody will use (``run_plan``): the interpreter's exit would wait for them."""
    return any(t.name.startswith(THREAD_NAME) and t.is_alive() for t in threading.enumerate())


class Device:
    """Where units are merged when not on the CPU (``merge.device``): each unit's inputs (or a row block's) are
    moved there one unit at a time (``lock``), merged, and the result moved back to the CPU.

    Random methods draw on the device itself: their draws are a function of each entry's index
    (methods/draws.py), the same bits on any device. ``torch_only``: the test hook that takes the CPU itself through
    this path, with the compiled kernels off on the merging threads (``fused.off``): the torch definitions a GPU
    runs, on the CPU. ``peak``: the most input bytes moved to the device at once (one unit's)."""

    def __init__(self, device: str | torch.device, torch_only: bool = False):
        self.device, self.torch_only = torch.device(device), torch_only
        self.lock = threading.Lock()
        self.resident = self.peak = 0

    def __str__(self) -> str:
        return str(self.device)

    def to_device(self, t: torch.Tensor) -> torch.Tensor:
        return t.to(self.device)

    def to_cpu(self, t: torch.Tensor) -> torch.Tensor:
        return t.to("cpu")

    @contextmanager
    def holding(self, tensors: Iterable[torch.Tensor]):
        """Around one unit's (or block's) time on the device: the units wait for each other here."""
        size = sum(t.numel() * t.element_size() for t in tensors)
        with self.lock:
            self.resident += size
            self.peak = max(self.peak, self.resident)
            try:
                yield
            finally:
                self.resident -= size

    def merge_unit(self, unit: Unit, method: MergeMethod, inputs, seed: int) -> dict[str, torch.Tensor]:
        """``_merge_unit`` on the device, its results on the CPU."""
        b, es = inputs
        with self.holding([*b.values(), *(t for e in es for t in e.values())]):
            moved = (
                {n: self.to_device(t) for n, t in b.items()},
                [{n: self.to_device(t) for n, t in e.items()} for e in es],
            )
            return {n: self.to_cpu(t) for n, t in _merge_unit(unit, method, moved, seed).items()}

    def merge_block(self, merger, offset: int, base: torch.Tensor, experts: list[torch.Tensor]) -> torch.Tensor:
        """A row merger's ``merge`` of one block on the device, its result on the CPU."""
        with self.holding([base, *experts]):
            return self.to_cpu(merger.merge(offset, self.to_device(base), [self.to_device(e) for e in experts]))


def placement(device: str | torch.device | Device | None) -> Device | None:
    """The ``Device`` a merge computes on for ``device`` (``merge.device``), or None for the CPU path. A CUDA
    device that is only simulated (core/gpus.py) computes on the CPU."""
    if device is None or isinstance(device, Device):
        return device
    from mergeval.core.gpus import compute_device

    target = torch.device(compute_device(str(device)))
    return None if target.type == "cpu" else Device(target)


def output_shapes(plan: list[Unit], shapes: dict[str, tuple[int, ...]], rows: dict[str, int]):
    """name -> shape of each output tensor, in plan order (the base's shape; vocab rows per policy)."""
    out = {}
    for unit in plan:
        for name in unit.names:
            out[name] = (rows[name], *shapes[name][1:]) if name in rows else shapes[name]
    return out


def run_plan(
    plan: list[Unit],
    method: MergeMethod,
    base,
    experts: list,
    seed: int,
    rows: dict[str, int],
    progress: bool = False,
    blocks: bool = False,
    prepared: dict | None = None,
    device: Device | None = None,
) -> Iterator[tuple[str, torch.Tensor | Blocks]]:
    """Yield (name, merged tensor) in plan order; ``base`` / ``experts`` are reader.py sources.

    WORKERS threads, each with one torch thread, read and merge units up to WINDOW ahead of the consumer (more
    while a larger unit runs: ``ordered``), which writes (or loads) the results in plan order: reading,
    merging and writing overlap, and every core merges, also in the steps torch runs on one thread
    (selections, random draws, small tensors).
    ``blocks=True`` (sources with ``get_rows``): a tensor of at least BLOCK_MIN entries whose method has a
    row-chunked form is yielded as ``Blocks`` (its row blocks, read and merged by the workers as the
    consumer iterates) instead of a tensor.
    ``prepared``: a dict kept by a caller that merges the same ``base`` and ``experts`` several times (a staged
    sweep's candidates); a row merger's ``prepare`` result that depends only on the inputs and its
    ``prepared_key`` (TIES' cut at each density) is stored there and reused, not computed again.
    ``device``: merge each unit (or row block) there, one at a time (``Device``); None: on the CPU.
    """
    # disable=None: a bar only on a terminal, so piped stderr keeps errors on one line
    bar = tqdm(plan, desc=f"merging ({method.name})", unit="unit", disable=None if progress else True)
    # The consumer's own torch work (copies into a live model, casts) runs on one thread while it iterates:
    # with more, each copy wakes torch's OpenMP helper, which then spin-waits on a core the workers need and
    # slows the whole in-memory merge down.
    torch_only = device is not None and device.torch_only
    if blocks and not torch_only:
        _load_kernels_first(plan, method, base, len(experts))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    pool = ThreadPoolExecutor(
        WORKERS, thread_name_prefix=THREAD_NAME, initializer=_worker_setup, initargs=(torch_only,)
    )
    finished = False
    try:

        def work(unit: Unit):
            if (
                blocks
                and (found := _blocks_of(unit, method, base, experts, seed, rows, pool, prepared, device)) is not None
            ):
                return found
            inputs = _read_unit(unit, base, experts, rows)
            if device is None or unit.kind == "copy":  # a copy unit is the base's tensor, as it is, on the CPU
                return _merge_unit(unit, method, inputs, seed)
            return device.merge_unit(unit, method, inputs, seed)

        for unit, merged in ordered(pool, work, bar, size=lambda unit: _entries(unit, base)):
            if isinstance(merged, Blocks):
                yield unit.key, merged
            else:
                yield from merged.items()
        finished = True
    finally:
        # Stopped early (an interruption, an error, a consumer that stopped iterating): units not started are
        # cancelled and the running ones are not waited for, since their results would be thrown away. Waiting
        # made Ctrl-C take as long as the slowest running unit (DELLA's ranks over a whole embedding, longer
        # the larger the model). The abandoned threads end with their unit;
        # a command that stopped for an interruption or an error does not wait for them (mergeval.run.cli.end_now).
        pool.shutdown(wait=finished, cancel_futures=True)
        torch.set_num_threads(threads)


def _worker_setup(torch_only: bool) -> None:
    """A merging thread: one torch thread; ``torch_only`` (Device's test hook): the compiled kernels off."""
    torch.set_num_threads(1)
    if torch_only:
        fused.off()


def _load_kernels_first(plan: list[Unit], method: MergeMethod, base, n_experts: int) -> None:
    """Load the compiled kernels here, before the workers start, where the merge's first tensor in row blocks
    will take them: its row merger's constructor decides that (``rows.kernel_applies``) and loads them.

    Why: loaded by the first worker (numba's import and registries), they kept the other worker waiting on
    numba's locks and the consumer on both, and the load took longer there than alone; loaded here it runs
    uncontended and the merge that follows is shorter by more than the load costs. A method whose
    row mergers do not take the kernels (task arithmetic, TIES) loads nothing."""
    if method.rows is None or not hasattr(base, "get_rows"):
        return
    for unit in plan:
        if unit.kind == "tensor":
            numel = math.prod(base.shapes[unit.names[0]])
            if numel >= BLOCK_MIN:
                method.rows(unit.cfg, n_experts, numel, fused.CompiledDraws(0, unit.key))
                return


def ordered(
    pool: ThreadPoolExecutor, fn: Callable, items: Iterable, window: int | None = None, size: Callable | None = None
) -> Iterator:
    """(item, fn(item)) in the order of ``items``, with up to ``window`` calls running ahead in ``pool``.

    ``size(item)`` (entries): while the oldest call still runs, later items start beyond the window as long as
    those queued behind it total no more than its own size. Why: one large whole-tensor unit (DELLA's ranks
    over a 28M-entry embedding: seconds on one thread) otherwise left the other workers idle behind a window
    of two units; what they finish meanwhile waits in memory, bounded by that unit's own size."""
    window = window or WINDOW
    pending: deque = deque()  # (item, future, size)
    behind = 0  # the summed size of the pending items after the oldest
    # A call raised: nothing after it in order will be yielded, so nothing more is submitted, and what was
    # submitted but starts only now does nothing (the pool starts calls in order, so all of them come after it).
    # Its error is raised as soon as it is known, not after the older calls still running: they may take
    # minutes (DELLA's ranks over a large embedding), and their results would be thrown away.
    failures: list = []  # the calls that raised, in the order they ended (appending is atomic)
    changed = threading.Condition()

    def note_end(future) -> None:
        with changed:
            if not future.cancelled() and future.exception() is not None:
                failures.append(future)
            changed.notify_all()

    def outcome(future):
        """``future``'s result, or the error of a call that raised while it still ran."""
        with changed:
            changed.wait_for(lambda: future.done() or failures)
        return (future if future.done() else failures[0]).result()

    def call(item):
        if failures:
            raise _AfterFailure
        return fn(item)

    try:
        for item in items:
            if failures:
                break
            cost = size(item) if size else 0
            if pending:
                behind += cost
            future = pool.submit(call, item)
            future.add_done_callback(note_end)
            pending.append((item, future, cost))
            while len(pending) > window:
                head, future, head_cost = pending[0]
                if size and not future.done() and behind <= head_cost:
                    break  # the oldest still runs: keep the other workers busy
                pending.popleft()
                behind -= pending[0][2]  # the next oldest is no longer behind
                yield head, outcome(future)
        while pending:
            head, future, _ = pending.popleft()
            yield head, outcome(future)
    finally:  # an error or an abandoned iteration: work not yet started is not started
        for _, future, _ in pending:
            future.cancel()


class _AfterFailure(Exception):
    """A call of ``ordered`` skipped because an earlier one failed (never raised to a caller)."""


def _entries(unit: Unit, base) -> int:
    """The entries of a unit's tensors (its size for ``ordered``)."""
    return sum(math.prod(base.shapes[name]) for name in unit.names)


def _read_unit(unit: Unit, base, experts: list, rows: dict[str, int]):
    """One unit's inputs read whole: (base {name: tensor}, [each expert's]), vocab rows aligned."""
    b = {n: base.get(n) for n in unit.names}
    if unit.kind == "copy":
        return b, []
    es = [{n: e.get(n) for n in unit.names} for e in experts]
    for n in unit.names:
        if n in rows:
            b[n], aligned = align(b[n], [e[n] for e in es], rows[n])
            for e, t in zip(es, aligned):
                e[n] = t
    return b, es


def _merge_unit(unit: Unit, method: MergeMethod, inputs, seed: int) -> dict[str, torch.Tensor]:
    """{name: merged tensor in the base's dtype} in the unit's order (a copy unit: the base's tensor)."""
    b, es = inputs
    if unit.kind == "copy":  # integer buffers (e.g. position ids) are not merged
        (name,) = unit.names
        return {name: b[name].clone()}
    gen = fused.CompiledDraws(seed, unit.key)
    if unit.kind == "tensor":
        assert method.merge is not None, "tensor units are of methods with a per-tensor merge (build_plan)"
        (name,) = unit.names
        out = {name: method.merge(b[name], [e[name] for e in es], unit.cfg, gen)}
    else:
        assert method.merge_layer is not None, "layer units are of methods with a layer merge (build_plan)"
        out = method.merge_layer(b, es, unit.cfg, gen)
        _check_layer_output(method.name, unit, b, out)
    return {name: out.pop(name).to(b[name].dtype) for name in unit.names}


class Blocks:
    """A merged tensor as row blocks, each merged in the pool when iterated (in order, WINDOW ahead)."""

    def __init__(
        self, merger, name: str, base, experts: list, spans: list[tuple[int, int]], pool, device: Device | None = None
    ):
        self.merger, self.name, self.base, self.experts, self.spans, self.pool, self.device = (
            merger,
            name,
            base,
            experts,
            spans,
            pool,
            device,
        )
        self.per_row = math.prod(base.shapes[name][1:])
        self.kernel_checks = getattr(merger, "checks_inputs", False)  # see merged
        # the compiled kernel's float32 experts are read into one stack, which it takes as it is (fused.StackedRows)
        self.stack_experts = (
            self.kernel_checks
            and device is None
            and all(isinstance(e, CheckpointReader) and e.dtypes[name] == torch.float32 for e in experts)
        )
        self.dtype: torch.dtype | None = None  # the dtype the blocks are cast to (``cast``); None: as merged

    def cast(self, dtype: torch.dtype) -> Blocks:
        """These blocks, each cast to ``dtype`` by the thread that merges it."""
        self.dtype = dtype
        return self

    def numels(self) -> list[int]:
        """Entries in each block, in order."""
        return [(r1 - r0) * self.per_row for r0, r1 in self.spans]

    def read(self, span: tuple[int, int], check: bool = True):
        """(flat offset of the block, base rows, each expert's rows); ``check=False``: not checked for NaN/Inf."""
        base = self.base.get_rows(self.name, *span, check=check)
        if not self.stack_experts:
            return span[0] * self.per_row, base, [e.get_rows(self.name, *span, check=check) for e in self.experts]
        stack = torch.empty((len(self.experts), *base.shape), dtype=torch.float32)
        experts = fused.StackedRows(
            e.get_rows(self.name, *span, check=check, out=stack[i]) for i, e in enumerate(self.experts)
        )
        experts.stacked = stack
        return span[0] * self.per_row, base, experts

    def read_all(self) -> Iterator:
        """``read`` of every block in order (a merger's passes; the reads are the page cache's)."""
        return map(self.read, self.spans)

    def merged(self, span: tuple[int, int]) -> torch.Tensor:
        """One block merged, in ``dtype`` when it is set."""
        block = self._merged(span)
        return block if self.dtype is None else block.to(self.dtype)

    def _merged(self, span: tuple[int, int]) -> torch.Tensor:
        """One block merged. A merger that ``checks_inputs`` (the compiled kernel's, which counts NaN and Inf in
        every entry it reads) gets its CPU blocks unchecked, which saves the readers a pass over every input;
        when it refuses one, the readers' check names the input (the base first, then the experts in order)
        in the same one-line error as for any other merge. On a ``device`` the blocks are read checked on the
        CPU and merged there by the torch code (``Device.merge_block``)."""
        if self.device is not None:
            return self.device.merge_block(self.merger, *self.read(span))
        if not self.kernel_checks:
            return self.merger.merge(*self.read(span))
        offset, base, experts = self.read(span, check=False)
        if base.device.type != "cpu":  # the kernel runs on the CPU only; elsewhere the torch code merges
            self._check(span, base, experts)
            return self.merger.merge(offset, base, experts)
        try:
            return self.merger.merge(offset, base, experts)
        except fused.NonFinite:
            self._check(span, base, experts)
            raise

    def _check(self, span: tuple[int, int], base: torch.Tensor, experts: list[torch.Tensor]) -> None:
        for source, rows in zip([self.base, *self.experts], [base, *experts]):
            source.check_rows(self.name, *span, rows)

    def __iter__(self) -> Iterator[torch.Tensor]:
        for _, block in ordered(self.pool, self.merged, self.spans):
            yield block

    def written(self, write: Callable[[int, torch.Tensor], None]) -> Iterator[int]:
        """Every block merged and handed to ``write(first row, block)`` by the thread that merged it (the
        writer's writes in place: writer.ShardWriter); yields each block's number of rows in order, once its
        write has returned."""

        def merge_and_write(span: tuple[int, int]) -> int:
            write(span[0], self.merged(span))
            return span[1] - span[0]

        for _, rows in ordered(self.pool, merge_and_write, self.spans):
            yield rows


def _blocks_of(
    unit: Unit,
    method: MergeMethod,
    base,
    experts: list,
    seed: int,
    rows: dict[str, int],
    pool,
    prepared: dict | None = None,
    device: Device | None = None,
):
    """The unit as ``Blocks`` when it is one large tensor, not vocab-aligned, whose method has a row-chunked
    form for its config (its ``prepare`` passes over the blocks run here, or its result is taken from
    ``prepared``: run_plan); else None."""
    if unit.kind != "tensor" or method.rows is None or not hasattr(base, "get_rows"):
        return None
    (name,) = unit.names
    shape = base.shapes[name]
    numel = math.prod(shape)
    small = numel < BLOCK_MIN and not fused.loaded(numel)  # smaller tensors take the kernels once loaded
    if name in rows or small or len(shape) == 0 or not base.dtypes[name].is_floating_point:
        return None
    gen = fused.CompiledDraws(seed, unit.key)
    merger = method.rows(unit.cfg, len(experts), numel, gen)
    if merger is None:
        return None
    blocks = Blocks(merger, name, base, experts, row_spans(shape, BLOCK_ENTRIES), pool, device)
    key = getattr(merger, "prepared_key", None)
    if prepared is None or key is None:
        merger.prepare(blocks)
        return blocks
    key = (name, key, tuple(blocks.spans))  # the cut's tie quotas are per block
    if key in prepared:
        merger.restore(prepared[key])
    else:
        merger.prepare(blocks)
        prepared[key] = merger.prepared()
    return blocks


def row_spans(shape: tuple[int, ...], entries: int) -> list[tuple[int, int]]:
    """(r0, r1) blocks of whole rows along dim 0, each about ``entries`` entries (at least one row)."""
    per_row = max(1, math.prod(shape[1:]))
    step = max(1, entries // per_row)
    return [(r0, min(r0 + step, shape[0])) for r0 in range(0, shape[0], step)]


def _check_layer_output(method: str, unit: Unit, base: dict[str, torch.Tensor], out: dict[str, torch.Tensor]):
    """A layer method must return exactly its layer's tensors with the base's shapes (a bug otherwise)."""
    if set(out) != set(unit.names):
        raise ValueError(
            f"{method}.merge_layer returned {sorted(set(out) ^ set(unit.names))[:3]} "
            f"differently from the layer {unit.key}'s tensors"
        )
    for n, t in out.items():
        if t.shape != base[n].shape:
            raise ValueError(
                f"{method}.merge_layer returned {n} with shape {list(t.shape)}, expected {list(base[n].shape)}"
            )
