"""The fused path's scorer: plans a batch into passes (whole states at a time, within a token budget and the bank's
room), finds or allocates each state's bank slot, runs the passes (replayed from CUDA graphs when one fits) and
reads the pointer head. Same interface as the reference scorer."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass

import torch

from ..model.qwen35 import Qwen35TextModel
from ..protocol.encoding import Encoded, EncodedQuestion
from ..scoring.contract import ScorerStats
from ..scoring.head import PendingProbabilities, batch_questions
from ..scoring.units import Units, run_units
from .fused import FusedQwen35
from .head import PointerHead
from .memory import BANK_SHARE, GpuMemoryError, MemoryPlan, gib, states_held
from .pass_kernels import PassKernels
from .passes import MIN_GEMM_ROWS, PassLayout, Row, exact_input, is_short, lay_out
from .pool import Continued, Extension, GpuBank, Slot, StatePool, slots_for
from .weights import FusedWeights

# The bank where none is given and the device is not a GPU (the fused pass's stand-ins on a CPU, in tests).
DEFAULT_CPU_BANK_BYTES = 1 << 30
# A state continuing a point costs a pass its tokens after the point and its rows' (what the pass computes and holds,
# within its memory plan), and as much again per this many tokens before the point, which every one of them attends
# to: a pass of continued states takes about as long as a pass of new states of the same budget. Kev-4B on an H100,
# a turn of ~470 tokens and rows: 11.3 ms computed as a new state, 17.2 ms continuing a point after 8k tokens (x1.5),
# 41.5 ms after 64k (x3.7; counted x5).
PREFIX_TOKENS_PER_COST = 16_384


def state_cost(tokens: int, rows_tokens: int, start: int) -> int:
    """What a state costs a pass (FusedScorer.next_pass): its tokens and its rows', or, continuing a point `start`
    tokens in, the tokens it computes after the point and its rows', as much again per PREFIX_TOKENS_PER_COST tokens
    before the point."""
    if not start:
        return tokens + rows_tokens
    return (tokens - start + rows_tokens) * (PREFIX_TOKENS_PER_COST + start) // PREFIX_TOKENS_PER_COST


Found = dict[tuple[int, ...], Continued | None]  # FusedScorer.next_pass: the point each new state of a pass continues
Picked = tuple[torch.Tensor, dict[tuple[int, int], int]]  # FusedScorer.run_group: a pass's picks, each <decide>'s row


@dataclass(frozen=True)
class FusedOptions:
    """How the fused scorer runs. The engine builds it from its own options (EngineOptions.fused), where every default
    is written: none is written here."""

    bank_bytes: int | None  # None: on a GPU, what the weights and the largest pass leave, at most a fifth of it
    pass_tokens: int  # tokens per pass (states, counted once, and their rows)
    max_state_tokens: int  # the longest state a request may hold (the request limits')
    max_row_tokens: int  # the most tokens of one state's rows (the request limits')
    # CUDA graphs for passes that fit a bucket of up to graph_max_tokens tokens (graphs.py), at most max_graphs kept;
    # off: every pass eagerly. Without CUDA nothing is captured: the padded passes run eagerly from the graphs' buffers.
    graphs: bool
    graph_max_tokens: int
    max_graphs: int
    gemm_algos: str  # which pre-tuned cuBLASLt table (cublaslt.pretuned)


class FusedScorer:
    """Same interface as ReferenceScorer: per request, per question, the option probabilities."""

    def __init__(
        self,
        model: Qwen35TextModel,
        head: dict[str, torch.Tensor],
        temperature: float,
        pad_id: int,
        options: FusedOptions,
        dtype: torch.dtype = torch.bfloat16,
        kernels: PassKernels | None = None,
    ) -> None:
        """`dtype` and `kernels` are what a CPU test changes (fp32, torch stand-ins for the GPU kernels)."""
        self.device = next(model.parameters()).device
        self.options = options
        self.weights = FusedWeights(model, dtype)
        self.pointer = PointerHead(head, temperature)
        self.pad_id = pad_id
        self.pass_tokens = options.pass_tokens
        self.max_state_tokens = options.max_state_tokens
        self.max_row_tokens = options.max_row_tokens
        self.dtype = dtype
        self.kernels = kernels
        self.memory: MemoryPlan | None = None  # how the bank was sized on a GPU (gpu/memory.py)
        bank_bytes = options.bank_bytes
        if bank_bytes is None and self.device.type == "cuda":
            self.memory = self.plan_memory()
            bank_bytes = self.memory.bank_bytes()
        self.bank_bytes = DEFAULT_CPU_BANK_BYTES if bank_bytes is None else bank_bytes
        self.bank = self._new_bank()
        self.model = self._new_model()
        self.graphs = self._new_graphs()
        self.oom_retries = 0
        # Unused: the fused path's units are its passes, and whoever drives them (engine/pipeline.py) reports them.
        self.on_progress: Callable[[], None] | None = None

    def _new_bank(self, capacity_bytes: int | None = None) -> GpuBank:
        """The bank: `bank_bytes`, or `capacity_bytes` (0: one state of max_state_tokens with its point, and the
        scratch slot)."""
        pool = StatePool.sized(
            self.weights.config,
            self.bank_bytes if capacity_bytes is None else capacity_bytes,
            self.device,
            self.dtype,
            min_slots=2,
            min_tokens=self.max_state_tokens + 64,
        )
        return GpuBank(pool)

    def plan_memory(self) -> MemoryPlan:
        """Measures, on a bank of one state of max_state_tokens, the working memory of the largest passes (plan): a
        new state of max_state_tokens with rows up to max_row_tokens, then pass_tokens of rows over that state once
        banked (their attention over a long prefix holds partial sums per part); and a pass of the graphs' largest
        bucket. Each runs eagerly; then all it made is freed (gpu/memory.py). Compiles the long kernels on the way."""
        device = self.device
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()  # what loading and fusing the weights left cached: the passes get it, unfragmented
        weights = torch.cuda.memory_allocated(device)
        self.graphs = None
        self.bank = self._new_bank(0)
        minimum = self.bank.pool.nbytes
        self.model = self._new_model()
        pad = self.pad_id  # the ids do not change what a pass holds

        def rows(state: tuple[int, ...], tokens: int, each: int) -> list[Row]:
            count = max(1, tokens // each)
            return [Row(0, q, EncodedQuestion(tokens=(pad,) * each, option_ends=()), state) for q in range(count)]

        def peak(group: list[Row]) -> int:
            torch.cuda.synchronize(device)
            torch.cuda.reset_peak_memory_stats(device)
            before = torch.cuda.memory_allocated(device)
            self.run_group(group)
            torch.cuda.synchronize(device)
            return torch.cuda.max_memory_allocated(device) - before

        state = (pad,) * self.max_state_tokens
        largest = max(self.max_row_tokens, self.pass_tokens, self.max_state_tokens + MIN_GEMM_ROWS)
        branch = largest - self.max_state_tokens
        graphed = max(self.options.graph_max_tokens, 2 * MIN_GEMM_ROWS)
        try:
            working = peak(rows(state, branch, branch))  # the state new, with its first rows
            working = max(working, peak(rows(state, self.pass_tokens, min(branch, self.pass_tokens))))  # banked
            self.bank.clear()
            graphs = peak(rows((pad,) * (graphed - MIN_GEMM_ROWS), MIN_GEMM_ROWS, MIN_GEMM_ROWS))
        except torch.cuda.OutOfMemoryError:
            total = torch.cuda.get_device_properties(device).total_memory
            raise GpuMemoryError(
                f"the model does not fit this GPU: beside its weights ({gib(weights)} of {gib(total)}) and a state "
                f"bank of one {self.max_state_tokens:,}-token state ({gib(minimum)}), its largest pass ({largest:,} "
                "tokens) ran out of memory. Serve it on a GPU with more memory, or lower max_state_tokens and "
                "max_row_tokens (KEV_MAX_STATE_TOKENS, KEV_MAX_ROW_TOKENS)"
            ) from None
        self.bank.clear()
        del self.model
        self.bank = None  # type: ignore[assignment]
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info(device)
        return MemoryPlan(
            total=total,
            free=free,
            weights=weights,
            working=working,
            graphs=graphs if self.options.graphs else 0,
            minimum=minimum,
            max_state_tokens=self.max_state_tokens,
            largest_pass_tokens=largest,
        )

    def bank_summary(self) -> str:
        """For the start-up line: the bank's size, where it came from, and how many states of each length it holds."""
        pool = self.bank.pool
        slots, pages = pool.scratch_slot, pool.pages
        held = ", ".join(
            f"{states_held(slots, pages, pool.page_size, n):,} of {n:,}"
            for n in sorted({self.max_state_tokens, 16_384, 2_048}, reverse=True)
            if n <= self.max_state_tokens
        )
        size = f"state bank {gib(pool.nbytes)}"
        if self.memory is not None:
            m = self.memory
            why = "a fifth of the GPU" if self.bank_bytes == m.total // BANK_SHARE else "what is left"
            size += (
                f" ({why}: weights {gib(m.weights)}, largest pass {gib(m.working)}, graphs {gib(m.graphs)}, "
                f"of {gib(m.total)})"
            )
        return f"{size}, holding states of tokens: {held}"

    def _new_model(self) -> FusedQwen35:
        return FusedQwen35(self.weights, self.bank.pool, self.kernels, self.options.gemm_algos)

    def _new_graphs(self):
        if not self.options.graphs:
            return None
        from .graphs import PassGraphs

        return PassGraphs(
            self.model,
            self.bank.pool,
            self.pad_id,
            max_tokens=self.options.graph_max_tokens,
            max_graphs=self.options.max_graphs,
            capture=self.device.type == "cuda",
        )

    def stats(self) -> ScorerStats:
        algos = self.model.gemm_algos
        tables = (
            {"gemm_table": algos.source, "gemm_shapes": len(algos.algos), "gemm_passed_over": algos.passed_over}
            if algos is not None
            else {}
        )
        if self.graphs is None:
            return ScorerStats(oom_retries=self.oom_retries, **tables)
        graphs = self.graphs.stats
        return ScorerStats(
            graph_replays=graphs.replays,
            graph_captures=graphs.captures,
            graph_capture_failures=graphs.capture_failures,
            graphs=graphs.count,
            graph_bytes=graphs.bytes,
            oom_retries=self.oom_retries,
            **tables,
        )

    def warm_graphs(self) -> None:
        """Captures every graph bucket (kev_backend/gpu/graphs.py), when graphs are on."""
        if self.graphs is not None:
            self.graphs.warm()

    def wide_states(self) -> int:
        """Long new states (each with a long question) for one pass of the chunked delta rule's wide configuration
        (kernels.delta_rule.segments_for_wide; Kev-4B on an H200: 3), at most 8: a toy model's few heads would need
        hundreds, and it compiles that configuration on its first busy pass instead."""
        from .kernels.delta_rule import segments_for_wide

        c = self.model.c
        return min(8, segments_for_wide(self.device, c.linear_num_value_heads, c.linear_value_head_dim))

    def warm_head(self) -> None:
        self.pointer.warm()

    def probabilities(self, batch: Sequence[Encoded]) -> list[list[list[float]]]:
        return self.launch(batch).result()

    def launch(self, batch: Sequence[Encoded]) -> PendingProbabilities:
        """Enqueues the batch's passes and head on the GPU without waiting for them (nor for earlier work): the
        result waits. Its bank slots are taken now; work enqueued earlier that read or wrote them runs first."""
        return run_units(self.units(batch))

    def units(self, batch: Sequence[Encoded]) -> Units:
        """`launch` a pass at a time: each step enqueues one pass (whole states with their rows, scoring/units.py).
        A pass reads and writes only its own states' slots and leaves its picks projected, so passes of other batches
        may be enqueued between two of this one's. Each pass is planned when it is enqueued (`next_pass`): what the
        bank holds then decides what its states compute."""
        rows = [Row(r, q, tokens, e.state) for r, e in enumerate(batch) for q, tokens in enumerate(e.questions)]
        if not rows:
            return PendingProbabilities(len(batch))
        projected: list[torch.Tensor] = []
        decide_at: dict[tuple[int, int], int] = {}  # each question's <decide> row in the projections
        base = 0
        while rows:
            if projected:
                yield
            group, found = self.next_pass(rows)
            for picked, decides in self.run_group_retrying(group, found):
                # Projected now: a replayed pass's picks live in its graph's output until the next replay.
                projected.append(self.pointer.project(picked))
                decide_at.update((key, base + row) for key, row in decides.items())
                base += picked.shape[0]
                rows = [row for row in rows if (row.request, row.question) not in decides]  # a pass may leave some
        order, widths = batch_questions(batch)
        probs = self.pointer.softmax(
            projected[0] if len(projected) == 1 else torch.cat(projected), [decide_at[key] for key in order], widths
        )
        return PendingProbabilities.copying(len(batch), order, widths, probs)

    def run_group_retrying(self, rows: list[Row], found: Found) -> list[Picked]:
        """`run_group`, retried on a fresh bank (and its pool and graphs) when the GPU runs out of memory, in the
        passes `plan` makes of the rows then (states that continued a point are computed whole: they take more
        passes); a second failure fails the batch. Passes already enqueued keep the tensors they read alive, and
        every other batch's state is in the bank only as a cache: it is computed again when asked for."""
        try:
            return [self.run_group(rows, found)]
        except torch.cuda.OutOfMemoryError:
            self.oom_retries += 1
            self.bank.clear()
            del self.model
            self.bank = None  # type: ignore[assignment]
            self.graphs = None
            torch.cuda.empty_cache()
            self.bank = self._new_bank()
            self.model = self._new_model()
            self.graphs = self._new_graphs()
            return [self.run_group(group) for group in self.plan(rows)]

    def work(self, encoded: Encoded) -> int:
        """What the request would cost a pass planned now (`next_pass`), read on any thread: an estimate, for the
        pipeline's parts (the bank may change before its pass is planned)."""
        state, bank = encoded.state, self.bank  # None for a moment while an out-of-memory retry builds a new one
        start = 0 if bank is None or state in bank else bank.continued_estimate(state)
        return state_cost(len(state), sum(len(q.tokens) for q in encoded.questions), start)

    def plan(self, rows: list[Row]) -> list[list[Row]]:
        """The passes `next_pass` makes of the rows, one after another, on the bank as it is (each pass's states
        banked for the passes after it)."""
        groups: list[list[Row]] = []
        planned: set[tuple[int, ...]] = set()
        while rows:
            group, _ = self.next_pass(rows, planned)
            groups.append(group)
            planned.update(row.state for row in group)
            taken = {(row.request, row.question) for row in group}
            rows = [row for row in rows if (row.request, row.question) not in taken]
        return groups

    def next_pass(self, rows: list[Row], planned: Collection[tuple[int, ...]] = ()) -> tuple[list[Row], Found]:
        """The rows of the next pass, whole states at a time in order, and the banked point each new state among them
        continues (GpuBank.continued, or None). Split by the token budget and by the bank's capacity (states pinned in
        one pass). A state's cost: its tokens, counted whether it is new or banked (or in `planned`: banked by then),
        plus its rows' tokens; a state continuing a point costs the tokens it computes after the point and its rows'
        tokens, and as much again per PREFIX_TOKENS_PER_COST tokens before the point (every one of them attends to
        all of those). One state's rows stay with it up to Kev's row limit (a state near max_state_tokens with a few
        questions is one pass); past that, a new state goes with the rows that fit it (at least one) and the rest
        follow in passes of rows only, up to the budget in their tokens, reading the state from the bank (computed
        again there only if another batch's pass evicted it in between). Those two passes are the largest there are,
        which bounds a pass's memory (plan_memory measures both)."""
        by_state: OrderedDict[tuple[int, ...], list[Row]] = OrderedDict()
        for row in rows:
            by_state.setdefault(row.state, []).append(row)
        current: list[Row] = []
        found: Found = {}
        cost = 0
        states = 0  # the pool slots the pass's states take (slots_for: a state keeping a point takes two)
        # The slots the bank can give (all but its scratch slot); a model without DeltaNet layers has none to lack.
        max_states = self.bank.pool.scratch_slot if len(self.bank.pool.recurrent) else 1 << 30
        page = self.bank.pool.page_size
        for state, members in by_state.items():
            rows_tokens = sum(len(m.tokens.tokens) for m in members)
            banked = state in planned or state in self.bank
            continued = None if banked else self.bank.continued(state)
            need = state_cost(len(state), rows_tokens, 0 if continued is None else continued[2].length)
            slots = slots_for(len(state), page)
            if current and (cost + need > self.pass_tokens or states + slots > max_states):
                break
            if not banked:
                found[state] = continued
            if need <= max(self.pass_tokens, self.max_row_tokens) or len(members) == 1:
                current.extend(members)
                cost += need
                states += slots
                continue
            # More work on one state than the largest pass, alone in this one: a new state with the rows that fit in
            # Kev's row limit (at least one); a banked one with the rows that fit the budget in their own tokens.
            cost, limit = (0, self.pass_tokens) if banked else (len(state), max(self.pass_tokens, self.max_row_tokens))
            for member in members:
                tokens = len(member.tokens.tokens)
                if current and cost + tokens > limit:
                    break
                current.append(member)
                cost += tokens
            break
        return current, found

    def run_group(self, rows: list[Row], found: Found | None = None) -> Picked:
        """One pass: the hidden states it picked [picks, d] (a replayed pass's: its graph's output, read before the
        next pass), and where each (request, question)'s <decide> is among them (its options follow it). `found`: the
        point each new state continues, as `next_pass` found them just before; without it each is looked up when its
        slot is allocated. A state whose point left the bank since (the state keeping it evicted to make room for one
        of this pass's) is left out with the states after it: computed whole it would pass the budget the pass was
        planned to. Their rows are not among the <decide>s; the caller plans them again."""
        states = list(OrderedDict.fromkeys(row.state for row in rows))
        pinned = set(states)
        slots: dict[tuple[int, ...], Slot] = {}
        how: dict[tuple[int, ...], Extension] = {}
        new: list[tuple[int, ...]] = []
        for state in states:
            slot = self.bank.get(state)
            if slot is None:
                continued = self.bank.continued(state) if found is None else found[state]
                if continued is not None and continued[0] not in self.bank:
                    if slots:
                        break
                    continued = self.bank.continued(state)  # (not after next_pass: nothing was allocated before it)
                # From the furthest banked point it continues, if any, keeping its own (gpu/pool.py).
                made = self.bank.allocate(state, pinned, continued)
                if made is None:
                    raise RuntimeError("the state bank cannot hold one pass's states: raise bank_bytes")
                slot, how[state] = made
                new.append(state)
            slots[state] = slot
        rows = [row for row in rows if row.state in slots]
        # Short segments before long ones, within the states and within the rows (stable): each length class is one
        # contiguous kernel group.
        new.sort(key=lambda state: not is_short(len(state)))
        rows = sorted(rows, key=lambda row: not is_short(len(row.tokens.tokens)))
        try:
            # One pass: the new states' tokens and the rows' share every GEMM.
            picked = self.forward(lay_out(rows, new, slots, self.bank.pool.page_size, how))
        except BaseException:
            for state in new:
                self.bank.forget(state)
            raise
        for state in new:
            self.bank.publish(state)
        decides = {}
        offset = 0
        for row in rows:  # in the layout's order: each row's <decide>, then its options' </opt> (PassLayout.row_picks)
            decides[(row.request, row.question)] = offset
            offset += 1 + len(row.tokens.option_ends)
        return picked, decides

    def forward(self, layout: PassLayout) -> torch.Tensor:
        """One pass: replayed from its bucket's CUDA graph when it has one, else eagerly."""
        if self.graphs is not None and (bucket := self.graphs.bucket_for(layout)) is not None:
            return self.graphs.run(bucket, layout)
        return self.model.forward(exact_input(layout, self.pad_id, self.device))
