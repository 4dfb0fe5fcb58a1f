"""Activation placement: how a training step spends the memory the budget
leaves after the process, the resident page and the trainable state.

Three things compete for that pool: the block pages, the activations, and
nothing else. Per step the planner picks

  tail_start s  blocks s..L-1 and the head run as one segment whose autodiff
                graph is kept from forward to backward (no recompute; their
                frozen weights are streamed, stream.py: read forward and
                again backward, so the pages need not fit together, only
                the copies the graph holds, `held`); blocks first..s-1 keep only their
                input as a checkpoint and are recomputed in the backward
                sweep (step.py). s = first: no block is recomputed, mlx-lm's
                own arithmetic; s = L: every trained block is.
  spilled       of the recomputed blocks, how many (the lowest, whose
                backward comes last) write their checkpoints to the SSD
                after the forward sweep and read them back through the pager
                (spill.py), instead of holding them
  parts         each batch is split into this many micro-batches of rows
                (step.split_batch), with the same math, when one batch's
                working set does not fit whole.
  ahead         the frozen prefix (the blocks below the first trained one)
                runs ahead for this many steps at once (prefix.py), reading
                its blocks once for all of them; their outputs wait in
                memory for their steps. 1: each step runs its own.
  head_chunk    with no tail, the head's loss and gradient run over chunks
                of tokens (step.head_loss_and_grad), each chunk's float32
                logits at most this many bytes (0: the trainer's
                head_chunk_bytes, by default none: one chunk, as mlx-lm
                computes it). A large vocabulary's logits are the step's
                largest working set at small budgets (151,936 tokens: 59 MB
                a 97-token row, 4x that with the softmax and gradients); in
                smaller chunks they take less, each chunk reading the head's
                weights once more. Every token's loss is its own, but a BLAS
                may give a row other bits in a product of other rows (about
                1e-9 on OpenBLAS): chunks only where the whole does not fit.

One more choice is made once, at start-up, not per step: where one
sequence's block does not fit whole, attention runs in chunks of query rows
for the whole run (attention.py; session.open_session), and every size here
is measured with it.

It picks the fastest pair whose predicted peak fits, from sizes measured on
the previous steps (step.paged_value_and_grad's probe: one recomputed
block's forward + vjp peak, the tail's peak) and, before any measurement,
from a conservative formula (session.estimate_sizes). A measured size is
scaled to other shapes in proportion to tokens, and to the padded length
once more (attention scores grow with its square). A tail longer than the
one measured is predicted in proportion to its blocks, which overestimates
(the head and the transient part do not grow with it), so a tail grows
over a few steps and never past what fits.

The predicted peak covers what the budget's pool holds during the step:

  pages        one page: the streamed tail and the sweeps below it use one
               at a time (the pager reads ahead into what the budget leaves)
  checkpoints  the input of every recomputed block, for every micro-batch,
               plus the hidden state being computed and its cotangent
  held         the tail's frozen tensors the graph keeps as copies (norm
               weights, biases, and weights a layer computes with directly)
  working set  the largest of: one recomputed block's forward + vjp, the
               tail's graph, the head's loss and gradient (chunked)
  ahead        the prefix's outputs for the steps to come (ahead - 1 steps'
               batches); or, when more, the prefix sweep's own peak (every
               batch's hidden state and the next block's output, and one
               forward block's working set, a micro-batch at a time)
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

from . import carry

# Relative cost of a step's parts, in forward passes of one block: a frozen
# block's backward (input gradients through the frozen weights, the
# adapters' gradients) costs about one forward, and a recomputed block one
# forward more. A split batch runs smaller matrix products: a few percent
# slower per extra part.
_SPLIT_COST = 0.03
# A spilled checkpoint is written and read back while other blocks compute;
# what is not hidden costs a little per block. Cheaper than splitting, as
# the governor's ladder orders them.
_SPILL_COST = 0.05
# The fewest tokens a planned head chunk holds (a row's): below about this
# many a chunk's product is bound by reading the head's weights, and more
# chunks cost time without saving much.
MIN_HEAD_CHUNK_TOKENS = 16
# Relative cost of each chunk more of the head's loss, per micro-batch: it
# reads the head's weights once more forward and backward. Against a block's
# forward that is a few percent where blocks compute on long sequences (an
# 8B model's head on a Mac GPU: ~1 ms against ~90 ms) and up to 2x on short
# ones on a CPU (151,936 x 896 float32: +0.09 s a chunk against a 0.04 s
# block at 97 tokens). Counted small: the planner chunks the head before
# recomputing a block or splitting a batch, which cost more where it matters
# (the head is chunked only where it does not fit whole).
_HEAD_CHUNK_COST = 0.01


@dataclass
class Sizes:
    """What one step's activations weigh, for a model."""

    hidden: int  # hidden size d
    itemsize: int  # bytes per activation element
    vocab: int
    # One block's forward + vjp working set, bytes per token, at `block_len`
    # (the padded length it was measured or estimated at).
    block_per_token: float
    block_len: int
    block_fixed: int = 0  # bytes that do not grow with tokens (a dequantized weight)
    # One row's block measured whole, per token (None: not measured):
    # what a row past the most tokens measured costs at most (block()).
    block_one_per_token: Optional[float] = None
    # The tail's measured peak, per token, at `tail_len`, for a
    # tail of `tail_blocks` blocks, measured on `tail_rows` rows (None:
    # never measured).
    tail_per_token: Optional[float] = None
    tail_len: int = 0
    tail_blocks: int = 0
    tail_rows: int = 1
    # The same tail measured on one row, per token, and at what padded
    # length (None: not measured, or another tail since).
    tail_one_per_token: Optional[float] = None
    tail_one_len: int = 0
    # One forward-only block's measured peak (a sweep's, with no graph kept),
    # per token, at `forward_len` (None: never measured; block() stands in).
    forward_per_token: Optional[float] = None
    forward_len: int = 0
    head_chunk_bytes: int = 0  # the most bytes of logits a chunk of the head holds (0: no cap)
    # The head's loss and gradient over its float32 logits' bytes, beside
    # the hidden state's gradient: 4 (the logits, softmax and their
    # gradients) until measured (session.open_session: Gemma 2's
    # softcapping keeps more, ~6; bfloat16 logits less, ~2).
    head_factor: float = 4.0
    # One carry's bytes per token (carry.py: keys and values a block passes
    # later ones), measured (None: estimated as two hidden states).
    carry_per_token: Optional[float] = None
    # tokens of the measure kept, per kind (learn)
    _tokens: Dict[str, int] = field(default_factory=dict, repr=False)

    def _scale(self, per_token: float, at_len: int, rows: int, length: int) -> int:
        return int(per_token * rows * length * max(1.0, length / max(1, at_len)))

    def block(self, rows: int, length: int) -> int:
        """One recomputed block's forward + vjp, for a micro-batch: the line
        through the measures (fixed + per token), up to the most tokens
        measured; beyond them each token also costs the fixed part's share
        of a one-row block (a row costs at most a one-row block whole). A
        block's growth per row is not a line: a 4-bit DoRA qwen3 block of
        512 (64 tokens a row) grew 3.0 MB a row up to 4 rows and 7.3 MB a
        row from 4 to 16, so the line through 1 and 3 rows planned 8 rows
        at 48 MB where they took 68 MB, and the first step peaked 10% over
        its prediction. The line through two measures is above the curve
        between them, not past them."""
        line = self._scale(self.block_per_token, self.block_len, rows, length) + self.block_fixed
        measured = self._tokens.get("block")
        if measured is None or rows * length <= measured:
            return line
        one = self.block_one_per_token
        if one is None:
            one = self.block_per_token + self.block_fixed / max(1, self.block_len)
        past = max(0.0, one - self.block_per_token)  # per token: a one-row block's, less the line's own
        return line + int(past * (rows * length - measured) * max(1.0, length / max(1, self.block_len)))

    def forward(self, rows: int, length: int) -> int:
        """One block's forward with no graph kept (the sweep below the tail),
        for a micro-batch: measured, or else a recomputed block's estimate
        (a forward and its vjp: more)."""
        if self.forward_per_token is None:
            return self.block(rows, length)
        return self._scale(self.forward_per_token, self.forward_len, rows, length)

    def head(self, rows: int, length: int, chunk: int = 0) -> int:
        """The chunked head's loss and gradient (float32 logits, softmax and
        their gradient for one chunk, and the hidden state's gradient), in
        chunks of `chunk` bytes of logits (0: head_chunk_bytes). Measured
        on a 151,936-token vocabulary, 97 tokens: 237.5 / 66.4 / 32.2 MB in
        chunks of 64 / 16 / 8 MB, against 236.2 / 67.5 / 33.9 by the
        unmeasured factor 4. A chunk holds whole tokens, at least one
        (step.head_chunks)."""
        logits = self.head_factor * self._head_tokens(rows, length, chunk) * self._logit_bytes(rows)
        return int(logits) + rows * length * self._head_token_bytes()

    def _logit_bytes(self, rows: int) -> int:
        """A token's float32 logits over `rows` rows (at least 1: a divisor)."""
        return max(1, rows * self.vocab * 4)

    def _head_tokens(self, rows: int, length: int, chunk: int = 0) -> int:
        """Tokens a chunk of `chunk` bytes of logits holds (0:
        head_chunk_bytes; none: the whole length), as step.head_chunks
        counts them: whole tokens, at least one."""
        chunk = chunk or self.head_chunk_bytes
        return max(1, min(length, chunk // self._logit_bytes(rows))) if chunk else length

    def _head_token_bytes(self) -> int:
        """What the head holds per token besides its logits: the hidden
        state's gradient, twice (its chunks' and their concatenation; MLX
        frees one before or after the other's peak from run to run: a 2 x
        96-token llama head took 98,557,468 or 98,606,624 bytes), and the
        token's targets, mask and loss (a few small arrays: 32 floats'
        room). A measure takes one gradient off (learn); the factor it
        leaves covers whatever else it caught, and this covers the rest:
        planned from the measure's factor alone, that head came out 460
        or 49,616 bytes short."""
        return (2 * self.hidden + 32) * 4

    def head_chunks(self, rows: int, length: int, chunk: int = 0) -> int:
        """How many chunks the head's loss runs in (step.head_chunks)."""
        return -(-length // self._head_tokens(rows, length, chunk))

    def head_chunk_options(self, rows: int, length: int) -> List[int]:
        """The chunks a step with no tail may run its head in: 0 (the
        default) and, where the default's chunk holds more than
        MIN_HEAD_CHUNK_TOKENS tokens, chunks of half as many tokens, and
        half that, down to that floor."""
        tokens = self._head_tokens(rows, length)
        out, n = [0], self.head_chunks(rows, length)
        while tokens > MIN_HEAD_CHUNK_TOKENS:
            n *= 2
            tokens = max(MIN_HEAD_CHUNK_TOKENS, -(-length // n))
            out.append(tokens * self._logit_bytes(rows))
        return out

    def tail(self, blocks: int, rows: int, length: int) -> int:
        """The tail segment's graph for `blocks` blocks and the head. From a
        measured tail of n0 blocks (M bytes): M * n / n0 for a longer one (an
        overestimate: the head does not grow with it), and M less (n0 - n)
        blocks' share of what is not the head for a shorter one."""
        if blocks <= 0:
            return 0
        head = 3 * rows * length * self.vocab * 4  # the whole head's graph: logits, softmax, gradient
        if self.tail_per_token is None:
            return self.block(rows, length) * blocks + head
        whole = self._tail_measured(rows, length)
        n0 = self.tail_blocks
        fixed = min(head, whole)
        return int(max(whole * blocks / n0, fixed + (whole - fixed) * blocks / n0))

    def _tail_measured(self, rows: int, length: int) -> int:
        """The measured tail (its tail_blocks blocks and the head) for
        `rows` rows of `length`, from its measure on tail_rows rows: T0.
        A tail holds a fixed part F (DoRA's dense weights: ~87% of a 1-row
        tail on a 4-bit qwen3) and a part p per row, T = F + p * rows, and
        one measure tells neither. Each estimate below is at least T where
        F <= tail_blocks * block_fixed (what no row grows) and p <= the
        blocks' and the head's growth per row:
          more rows: T0 per token (F counted each row), or, where a block
            was measured, T0 plus the blocks' and head's growth from r0
            rows to these (block(): past the rows measured, steeper), the
            lesser; planned per
            token alone, a 4-bit DoRA tail measured on 1 row planned 2.8x
            what 4 rows took, and the first step split its batch;
          fewer rows: where the tail was measured on one row too (T1),
            the line through T1 and T0 (a tail's growth per row grows
            with its rows, as a block's: the line is above it between its
            measures); else F at its most, and what is left of T0 per row
            (per token alone would leave F out of a split batch's parts)."""
        r0, n0 = self.tail_rows, self.tail_blocks
        per_token = self._scale(self.tail_per_token, self.tail_len, rows, length)
        if rows == r0:
            return per_token
        t0 = self._scale(self.tail_per_token, self.tail_len, r0, length)
        if rows < r0 and self.tail_one_per_token is not None:
            t1 = self._scale(self.tail_one_per_token, self.tail_one_len, 1, length)
            return int(t1 + (t0 - t1) * (rows - 1) / (r0 - 1))
        if rows < r0:
            fixed = min(n0 * self.block_fixed, t0)
            return int(fixed + (t0 - fixed) * rows / r0)
        if "block" not in self._tokens:  # the formula's block: no bound on p
            return per_token
        grown = n0 * (self.block(rows, length) - self.block(r0, length)) + (rows - r0) * 3 * length * self.vocab * 4
        return int(min(per_token, t0 + grown))

    def checkpoint(self, rows: int, length: int) -> int:
        return rows * length * self.hidden * self.itemsize

    def carry(self, rows: int, length: int) -> int:
        """One carry kept for a micro-batch (keys and values: at most about
        two hidden states, until measured)."""
        if self.carry_per_token is None:
            return 2 * self.checkpoint(rows, length)
        return int(self.carry_per_token * rows * length)

    def learn(self, probe: dict) -> None:
        """Takes in what a step measured (step.paged_value_and_grad's probe).
        A measure over fewer tokens than the one kept does not replace it
        (a short batch's per-token figure understates a long one's: fixed
        costs, attention's square)."""
        if "block_one" in probe:
            nbytes, length = probe["block_one"]
            self.block_one_per_token = nbytes / max(1, length)
        if "block_fixed" in probe:
            # measured (session.open_session: one block on one sequence and
            # on a batch's); never below the formula's weight copy
            self.block_fixed = max(self.block_fixed, int(probe["block_fixed"]))
        if "block" in probe:
            nbytes, rows, length = probe["block"]
            if self._longer("block", rows * length):
                self.block_per_token = max(0, nbytes - self.block_fixed) / max(1, rows * length)
                self.block_len = length
        if "forward" in probe:
            nbytes, rows, length = probe["forward"]
            if self._longer("forward", rows * length):
                self.forward_per_token = nbytes / max(1, rows * length)
                self.forward_len = length
        if "head" in probe:
            nbytes, rows, length = probe["head"]
            logits = rows * length * self.vocab * 4
            # (less one hidden state's gradient: head() adds it, and room
            # for a second, which a measure may or may not have caught)
            self.head_factor = max(1.0, (nbytes - rows * length * self.hidden * 4) / max(1, logits))
        if "carried" in probe:
            nbytes, rows, length, count = probe["carried"]
            if count and self._longer("carried", rows * length):
                self.carry_per_token = nbytes / max(1, rows * length * count)
        if "tail" in probe:
            nbytes, blocks, rows, length = probe["tail"]
            if blocks != self.tail_blocks:
                self._tokens.pop("tail", None)  # another tail: its measure replaces the old one
                self._tokens.pop("tail_one", None)
                self.tail_one_per_token = None
            if rows == 1 and self._tokens.get("tail_one", 0) <= length:
                self._tokens["tail_one"] = length
                self.tail_one_per_token, self.tail_one_len = nbytes / max(1, length), length
            if self._longer("tail", rows * length):
                self.tail_per_token = nbytes / max(1, rows * length)
                self.tail_len = length
                self.tail_blocks = blocks
                self.tail_rows = rows

    def with_measure(self, what: str, nbytes: int, length: int) -> "Sizes":
        """A copy planned from one block's `what` ("block": forward + vjp;
        "forward") measured at `nbytes` on one sequence of `length` tokens,
        instead of the measures of it kept (session.open_session weighs
        attention in chunks with it)."""
        trial = copy.deepcopy(self)
        trial._tokens.pop(what, None)
        if what == "block":
            trial.block_one_per_token = None
        trial.learn({what: (nbytes, 1, length)})
        return trial

    def _longer(self, what: str, tokens: int) -> bool:
        """Whether a measure of `what` over `tokens` tokens replaces the one kept."""
        if tokens < self._tokens.get(what, 0):
            return False
        self._tokens[what] = tokens
        return True


@dataclass(frozen=True)
class Placement:
    tail_start: int
    parts: int
    pages: int  # bytes of pages the step needs at least
    activations: int  # bytes of checkpoints and working set, predicted
    recomputed: int  # blocks recomputed in the backward sweep
    cost: float  # relative step time (forward passes of one block)
    spilled: int = 0  # of the recomputed blocks, the lowest ones whose checkpoints go to the SSD
    ahead: int = 1  # steps the frozen prefix runs ahead for (prefix.py)
    waiting: int = 0  # bytes of the prefix's outputs waiting for the steps to come (in activations)
    head_chunk: int = 0  # with no tail, the head's chunk of logits, bytes (0: the sizes' head_chunk_bytes)

    @property
    def need(self) -> int:
        return self.pages + self.activations


@dataclass
class Step:
    """The shape of the steps to plan for."""

    num_blocks: int
    first_trained: int
    footprints: List[int]  # each block page's charge
    rows: int  # rows per batch
    length: int  # padded length (the longest the data can make)
    batches: int = 1  # batches per optimizer step (gradient accumulation)
    held: Optional[List[int]] = None  # per block: bytes a streamed tail holds as copies (None: 0)
    ahead: int = 1  # steps the frozen prefix may run ahead for (prefix.py; 1: none)
    # (producer, last consumer) per carry (carry.py): state a block passes
    # later ones, kept from its forward to the consumer's backward; no tail
    # starts between the two where the producer is trained. Producer -1
    # (carry.PREFIX): made before block 0 by adapters outside the blocks,
    # always trained.
    carries: List[Tuple[int, int]] = field(default_factory=list)

    def trained(self, producer: int) -> bool:
        """Whether a carry of `producer` has cotangents (carry.trained)."""
        return carry.trained(producer, self.first_trained)

    def tail_allowed(self, s: int) -> bool:
        """Whether a tail may start at s: no carry from a trained block
        crosses it (the paged step would run it as none; a frozen one's
        enters the tail as a constant)."""
        return not any(self.trained(p) and p < s <= c for p, c in self.carries)

    def micro_batches(self, parts: int) -> int:
        """Micro-batches per step when each batch is split into `parts`."""
        size = -(-self.rows // parts)
        return self.batches * -(-self.rows // size)


def evaluate(
    step: Step, sizes: Sizes, tail_start: int, parts: int, spilled: int = 0, ahead: int = 1, head_chunk: int = 0
) -> Placement:
    """The pages, activations and cost of one placement (`head_chunk`:
    where it has no tail)."""
    L, first, fp = step.num_blocks, step.first_trained, step.footprints
    s = max(first, min(L, tail_start))
    rows = -(-step.rows // parts)  # rows per micro-batch
    length = step.length
    # A streamed tail needs one page at a time, as a sweep does (more lets
    # reads overlap compute: the pager reads ahead into whatever the budget
    # leaves); the sweep's page is released before the tail starts, and the
    # tail's before the sweep below it.
    pages = max(fp)
    held = sum(step.held[s:]) if step.held else 0
    recomputed = s - first
    spilled = max(0, min(spilled, recomputed))
    # Checkpoints hold every micro-batch of the step (layer-major order),
    # whole batches' worth; +2: the hidden state in flight and its cotangent.
    batch_ckpt = step.batches * sizes.checkpoint(step.rows, length)
    checkpoints = (recomputed - spilled + 2) * batch_ckpt
    if spilled:
        # One block's spilled checkpoints read back at a time (its pages, with
        # one more block's read ahead), and one being written.
        pages += 2 * step.micro_batches(parts) * _slot(sizes.checkpoint(rows, length))
        checkpoints += sizes.checkpoint(rows, length)
    work = [sizes.forward(rows, length)]  # a block of the forward sweep
    if recomputed:
        work.append(sizes.block(rows, length))  # a recomputed block: forward and vjp
    if s < L:
        head_chunk = 0  # the tail's graph holds the head's (its measure has it)
        work.append(sizes.tail(L - s, rows, length))
    else:
        work.append(sizes.head(rows, length, head_chunk))
    trained = L - first
    cost = (L + trained + recomputed) * (1 + _SPLIT_COST * (parts - 1)) + _SPILL_COST * spilled
    if head_chunk:
        more = sizes.head_chunks(rows, length, head_chunk) - sizes.head_chunks(rows, length)
        cost += _HEAD_CHUNK_COST * step.micro_batches(parts) * more
    # Carries made below the tail, kept for the step (one per micro-batch
    # each); those in the tail are its graph's (its measure has them).
    # A trained producer's carries also have cotangents, summed from their
    # consumers' backward down to its own (step.py: pending), as large.
    carried = step.batches * sizes.carry(step.rows, length)
    carried *= sum(1 for p, _ in step.carries if p < s) + sum(1 for p, _ in step.carries if step.trained(p) and p < s)
    activations = checkpoints + held + max(work) + carried
    ahead = max(1, ahead) if first > 0 else 1
    waiting = (ahead - 1) * prefix_outputs(step, sizes, step.rows)
    if ahead > 1:
        # The prefix's outputs for the steps to come wait beside this
        # step; the sweep itself holds every batch's input and output, and
        # one forward block's working set (a micro-batch at a time).
        sweep = 2 * ahead * prefix_outputs(step, sizes, step.rows) + sizes.forward(rows, length)
        activations = max(activations + waiting, sweep)
    return Placement(s, parts, pages, activations, recomputed, cost, spilled, ahead, waiting, head_chunk)


def prefix_outputs(step: Step, sizes: Sizes, rows: int) -> int:
    """One step's outputs of the frozen prefix (prefix.py): each batch's
    hidden state, and the carries that blocks above the prefix take from
    blocks in it."""
    first, length = step.first_trained, step.length
    entering = sum(1 for p, c in step.carries if p < first <= c)
    return step.batches * (sizes.checkpoint(rows, length) + entering * sizes.carry(rows, length))


# Spill slots are whole direct-I/O blocks (the core's IO_ALIGN; this module
# stays free of the extension so that it can be tested on its own).
_SLOT_ALIGN = 4096


def _slot(nbytes: int, align: int = _SLOT_ALIGN) -> int:
    return -(-nbytes // align) * align


def candidates(step: Step, sizes: Sizes) -> List[Placement]:
    out = []
    for parts in range(1, step.rows + 1):
        if parts > 1 and -(-step.rows // parts) == -(-step.rows // (parts - 1)):
            continue  # the same micro-batch size as fewer parts
        for s in range(step.first_trained, step.num_blocks + 1):
            if not step.tail_allowed(s):
                continue
            r = s - step.first_trained
            chunks = sizes.head_chunk_options(-(-step.rows // parts), step.length) if s == step.num_blocks else [0]
            for spilled in sorted({0, r, r // 4, r // 2, 3 * r // 4}):
                for ahead in sorted({1, step.ahead}):
                    for chunk in chunks:
                        out.append(evaluate(step, sizes, s, parts, spilled, ahead, chunk))
    return out


def choose(
    step: Step,
    sizes: Sizes,
    pool: int,
    page_cap: Optional[int] = None,
    at_most: Optional[Placement] = None,
    ceiling: Optional[Placement] = None,
) -> Optional[Placement]:
    """The cheapest placement whose pages and activations fit in `pool`
    bytes (None when none does); with `page_cap`, whose pages fit in it.
    `at_most`: only placements that need less than it (the governor's
    ladder, after a step did not fit). `ceiling`: none with a longer tail,
    fewer spilled blocks or fewer parts than it (where the ladder has been,
    a run does not return).

    Of equal cost, one that leaves the pages room for every block (reads
    nothing) comes first; then the one that runs the prefix furthest ahead
    (fewest reads), or where nothing is read, not ahead (nothing to
    save)."""
    fits = [p for p in candidates(step, sizes) if p.need <= pool and (page_cap is None or p.pages <= page_cap)]
    fits = [p for p in fits if _below(p, at_most) and _below(p, ceiling)]
    if at_most is not None:
        # Less than `at_most` needs by today's sizes.
        below = evaluate(step, sizes, *evaluate_args(at_most)).need
        fits = [p for p in fits if p.need < below]
    if not fits:
        return None
    weights = sum(step.footprints)

    def reads(p: Placement) -> bool:
        room = pool - p.activations
        return min(room, page_cap) < weights if page_cap is not None else room < weights

    return min(fits, key=lambda p: (p.cost, reads(p), -p.ahead if reads(p) else p.ahead, p.need))


def evaluate_args(p: Placement) -> tuple:
    """evaluate's arguments after step and sizes, for `p` again."""
    return p.tail_start, p.parts, p.spilled, p.ahead, p.head_chunk


def _chunk(p: Placement) -> float:
    """The head's chunk, ordered: the default (0) above every planned one."""
    return p.head_chunk or float("inf")


def _below(p: Placement, bound: Optional[Placement]) -> bool:
    """Whether `p` is at or down the ladder from `bound` (None: no bound): no
    longer tail, no fewer spilled blocks or parts, the prefix no further
    ahead, the head's chunks no larger."""
    return bound is None or (
        p.parts >= bound.parts
        and p.tail_start >= bound.tail_start
        and p.spilled >= bound.spilled
        and p.ahead <= bound.ahead
        and _chunk(p) <= _chunk(bound)
    )


def least(step: Step, sizes: Sizes, ceiling: Optional[Placement] = None) -> Placement:
    """The placement that needs the least memory among those `ceiling`
    allows (as choose's): where nothing fits, the one to run
    (Session.after_step)."""
    allowed = [p for p in candidates(step, sizes) if _below(p, ceiling)]
    return min(allowed or candidates(step, sizes), key=lambda p: (p.need, p.cost))


def rung(old: Placement, new: Placement) -> Optional[str]:
    """The ladder's rung from `old` to `new` (governor records): "split",
    "spill", "recompute" or "head" (the head's loss in smaller chunks);
    None where none of those."""
    if new.parts > old.parts:
        return "split"
    if new.spilled > old.spilled:
        return "spill"
    if new.tail_start > old.tail_start:
        return "recompute"
    return "head" if _chunk(new) < _chunk(old) else None


def smallest(step: Step, sizes: Sizes) -> Placement:
    """The placement that needs the least memory (every block recomputed,
    one row per micro-batch): what the budget must hold at the least."""
    return min(candidates(step, sizes), key=lambda p: p.need)


def describe(p: Placement, num_blocks: int) -> str:
    tail = "none" if p.tail_start >= num_blocks else f"blocks {p.tail_start}..{num_blocks - 1}"
    spill = f" ({p.spilled} checkpoints spilled to the SSD)" if p.spilled else ""
    ahead = f", frozen prefix {p.ahead} steps ahead" if p.ahead > 1 else ""
    head = f", the head's loss in chunks of {p.head_chunk / 1e6:.1f}MB of logits" if p.head_chunk else ""
    return f"no-recompute tail {tail}, {p.recomputed} recomputed{spill}, batch in {p.parts} part(s){ahead}{head}"
