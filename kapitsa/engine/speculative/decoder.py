"""`SpeculativeDecode`: a decode strategy that drafts, verifies in one forward, and rolls back.

Per step and per sequence: a drafter proposes up to k tokens (k from the adaptive controller and
the tokens the sequence may still emit); the target runs `[last, d1..dk]` for every row at once
(ragged rows, `record=True`); acceptance keeps the tokens the target itself would have produced
(greedy: its argmax; sampling: speculative sampling, so outputs follow the target distribution);
`cache.rollback` drops each row's rejected tokens by replaying the recurrent layers over the kept
prefix. Rows with no draft ride along with length 1, which is plain decoding.
"""

from __future__ import annotations

from collections.abc import Callable
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field

import mlx.core as mx

from kapitsa.engine.cache.hybrid import HybridCache
from kapitsa.engine.kernels import backend
from kapitsa.engine.runner.decode import PlainDecode
from kapitsa.engine.runner.model_runner import ModelRunner
from kapitsa.engine.runner.prompt_tail import TailRequest
from kapitsa.engine.runner.sampler import SampledToken
from kapitsa.engine.runner.sequence import Sequence
from kapitsa.engine.speculative.acceptance import accept_chain, accept_tree, is_plain_greedy
from kapitsa.engine.speculative.batch_gate import RowPlan, batch_verify_pays
from kapitsa.engine.speculative.controller import (
    DEFAULT_MAX_DRAFT,
    DraftLengthController,
    default_cost_curve,
    gpu_cost_curve,
)
from kapitsa.engine.speculative.drafter import Drafter
from kapitsa.engine.speculative.shadow import ShadowGuess
from kapitsa.engine.speculative.tree import DraftTree
from kapitsa.engine.speculative.widths import GPU_VERIFY_WIDTHS, pad_drafts, verify_widths, width_for

# The acceptance a host drafter's controller assumes before its first guess is scored: on a GPU
# that is below what pays for a verify (its sequences start with pipelined plain steps and turn
# speculation on once guesses match), on the CPU's cheaper verifies it still pays. Its estimate
# also forgets faster: scored guesses come every few tokens, and a copy run after free text (an
# agent quoting code it read) should turn speculation on within a few guesses.
HOST_DRAFTER_PRIOR = 0.5
HOST_DRAFTER_DECAY = 0.8
# What leaving pipelined decoding for a verify costs on a GPU, in decode steps, beyond the verify:
# the step in flight is waited for, and the plain step after a failed draft restarts the pipeline
# unoverlapped. On the H200's 27B, isolated failing verifies on prose cost ~1.8 steps each beyond
# the tokens they gave, against the 0.8 the verify's own price accounts for.
PIPELINE_EXIT_COST_GPU = 1.0


@dataclass
class _SequenceState:
    seq: Sequence
    drafter: Drafter
    controller: DraftLengthController
    shadow: ShadowGuess = field(default_factory=ShadowGuess)
    exit_cost: float = 0.0  # decode steps a verify costs beyond its price when it leaves the pipeline
    # the drafter's kind, read once: the engine asks `_would_verify` every decode step, and on a
    # host-bound step (small and MoE models on a GPU) each microsecond of it is a microsecond of
    # decode time
    on_host: bool = False  # drafts on the host alone (n-gram): guesses are scored while resting
    needs_target: bool = False  # reads the target's hidden states or taps: never pipelines
    # the draft being verified: its tokens copied from the request's predicted output (usage counts them)
    from_prediction: tuple[int, ...] = ()
    probing: bool = False  # the draft being verified is the controller's probe while speculation rests

    def __post_init__(self) -> None:
        drafter = self.drafter
        self.on_host = bool(getattr(drafter, "drafts_on_host", False))
        self.needs_target = bool(
            getattr(drafter, "needs_hidden", False) or getattr(drafter, "tap_layers", ())
        )


@dataclass
class SpeculativeStats:
    steps: int = 0  # verify forwards
    proposed: int = 0
    accepted: int = 0
    emitted: int = 0  # tokens returned (accepted drafts + one from the target per row)
    rows: int = 0  # sequence-steps
    pipeline_exits: int = 0  # times a sequence's draft took the engine out of pipelined plain steps

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.proposed if self.proposed else 0.0

    @property
    def tokens_per_step(self) -> float:
        return self.emitted / self.rows if self.rows else 0.0


@dataclass
class SpeculativeDecode:
    """Args:
    make_drafter: builds one drafter per sequence (drafters keep per-sequence state).
    name: the mode reported in stats ("ngram", "draft", ...).
    max_draft: the longest draft per step.
    adaptive: choose each sequence's draft length from running acceptance (else always max_draft).
    cost_curve: verify cost c(T) relative to a decode step, T = 1..max_draft+1; None picks the
        measured GPU curve on a GPU, the bandwidth-only default elsewhere.
    verify_widths: the verify widths (1 + draft tokens) drafts are padded up to; None picks
        GPU_VERIFY_WIDTHS on a GPU and no padding elsewhere, () turns padding off. Padding is
        exact: a padded position is verified like any draft token (kept only if it is the token
        the target picks), and it never lets a row emit more than its max_tokens.
    """

    make_drafter: Callable[[], Drafter]
    name: str = "ngram"
    max_draft: int = DEFAULT_MAX_DRAFT
    adaptive: bool = True
    tree: bool = False  # verify a draft tree (drafters with `propose_tree`) instead of a chain
    cost_curve: list[float] | None = None
    verify_widths: tuple[int, ...] | None = None
    stats: SpeculativeStats = field(default_factory=SpeculativeStats)
    _states: dict[int, _SequenceState] = field(default_factory=dict)
    _plain: PlainDecode = field(default_factory=PlainDecode)
    _pipelined: bool = False  # the engine's last step ran pipelined (a verify must leave it)
    _tail_request: TailRequest | None | bool = False  # False: not read off a drafter yet
    _step_count: int = 0  # decode steps the engine has asked `wants_pipeline` about
    _probed_at: int = -(1 << 30)  # the step count of the batch's last probe step

    @property
    def acceptance_rate(self) -> float:
        return self.stats.acceptance_rate

    @property
    def tokens_per_step(self) -> float:
        return self.stats.tokens_per_step

    @property
    def prompt_tail_request(self) -> TailRequest | None:
        """What the prefill keeps of the prompt for this decoder's drafters (their hidden states
        or taps, prompt_tail.py), read off one drafter; None when they read only tokens."""
        if self._tail_request is False:
            probe = self.make_drafter()
            normed = bool(getattr(probe, "needs_hidden", False))
            taps = tuple(getattr(probe, "tap_layers", ()))
            self._tail_request = TailRequest(normed=normed, taps=taps) if normed or taps else None
        return self._tail_request

    def wants_pipeline(self, sequences: Seq[Sequence]) -> bool:
        """True while no sequence would verify a draft now: the engine then runs plain steps
        pipelined (as without speculation) instead of calling `step`.

        A host drafter (n-gram) keeps guessing meanwhile, and its guesses are scored against the
        tokens that arrive (shadow.py), so noticing that drafts fail costs no verify and no sync;
        a sequence verifies once its scored acceptance pays and it has a draft. Other drafters
        rest between probes; one that needs the target's hidden states never pipelines."""
        if not sequences:
            return False
        self._forget_finished(sequences)
        self._step_count += 1
        was_pipelined = self._pipelined
        states = [self._state(seq) for seq in sequences]
        plans = [self._plan(state) for state in states]
        verify = any(plan is not None for plan in plans)
        if verify and len(states) > 1 and self.adaptive and not any(st.needs_target for st in states):
            verify = self._plans_pay(states, plans)
        self._pipelined = not verify
        self.stats.pipeline_exits += was_pipelined and not self._pipelined
        return self._pipelined

    def _plan(self, state: _SequenceState) -> RowPlan | None:
        """What `state`'s sequence would verify now (None: it would take a plain step)."""
        drafter, seq, controller = state.drafter, state.seq, state.controller
        if state.needs_target:
            return RowPlan(self.max_draft, float(self.max_draft + 1))
        position, room = len(seq.output_ids), seq.max_tokens - len(seq.output_ids) - 1
        if not state.on_host:
            if controller.resting(position):
                return None
            k = min(controller.best_length(), room)
            if k > 0:
                return RowPlan(k, controller.expected_tokens(k))
            controller.note_off(position)  # as `choose` would: speculation rests from here
            if controller.resting(position):
                return None
            return RowPlan(1, controller.expected_tokens(1), probe=True)
        context, shadow = seq.token_ids, state.shadow
        shadow.score(context, controller)
        if room <= 0:
            return None
        exit_cost = state.exit_cost if self._pipelined else 0.0
        k = controller.best_length(shadow.current_run, exit_cost) if self.adaptive else self.max_draft
        k = min(k, room)
        if k > 0:
            draft = tuple(drafter.propose(context, k).tokens)
            expected = controller.expected_tokens(len(draft), shadow.current_run)
            return RowPlan(len(draft), expected, draft=draft) if draft else None
        if not shadow.live:
            shadow.guess(drafter.propose(context, self.max_draft).tokens, len(context))
        return None

    def _plans_pay(self, states: list[_SequenceState], plans: list[RowPlan | None]) -> bool:
        """Whether a batch's plans pay for leaving pipelined steps to verify every row. A device
        drafter's due probe does, once per `probe_every` steps of the batch (its rows' probes due
        by then go together: each keeps its estimate current); a host drafter's draft the batch
        does not verify is scored as a guess instead."""
        if any(plan is not None and plan.probe for plan in plans) and self._probe_window_open(states):
            return True
        expected = [1.0 if plan is None else plan.expected for plan in plans]
        width = 1 + max(0 if plan is None else plan.length for plan in plans)
        exit_cost = states[0].exit_cost if self._pipelined else 0.0
        if self._batch_pays(states, expected, width, exit_cost):
            return True
        for state, plan in zip(states, plans, strict=True):
            if plan is not None and plan.draft and not state.shadow.live:
                state.shadow.guess(plan.draft, len(state.seq.token_ids))
        return False

    def _probe_window_open(self, states: list[_SequenceState]) -> bool:
        """Whether the batch may probe now: `probe_every` steps since its last probe verified (the
        step that leaves the pipeline may only drain it; the window stays open until a probe runs)."""
        return self._step_count - self._probed_at >= states[0].controller.probe_every

    def _batch_pays(
        self, states: list[_SequenceState], expected: list[float], width: int, extra_cost: float = 0.0
    ) -> bool:
        """Whether the rows' drafts together pay for a verify of the whole batch (batch_gate.py)."""
        controller = states[0].controller
        return batch_verify_pays(
            expected, controller.cost, self._width_for(width), extra_cost=extra_cost, margin=controller.margin
        )

    def _drop_unpaid(self, states: list[_SequenceState], drafts: list[list[int]]) -> list[list[int]]:
        """The batch's drafts, or none when together they do not pay for a verify of every row;
        a host drafter's dropped draft is then scored as a guess against the tokens that arrive."""
        if len(states) < 2 or not self.adaptive or not any(drafts):
            return drafts
        probing = any(st.probing for st, d in zip(states, drafts, strict=True) if d)
        if probing and self._probe_window_open(states):
            self._probed_at = self._step_count
            return drafts  # the batch's probe step
        expected = [
            st.controller.expected_tokens(len(d), _run(st)) if d else 1.0
            for st, d in zip(states, drafts, strict=True)
        ]
        if self._batch_pays(states, expected, 1 + max(len(d) for d in drafts)):
            return drafts
        for state, draft in zip(states, drafts, strict=True):
            state.from_prediction = ()  # no verify: none of it is proposed
            if draft and state.on_host:
                state.shadow.start(draft, len(state.seq.token_ids))
        return [[] for _ in drafts]

    def step(
        self, runner: ModelRunner, cache: HybridCache, sequences: Seq[Sequence]
    ) -> list[list[SampledToken]]:
        self._forget_finished(sequences)
        states = [self._state(seq) for seq in sequences]
        for state in states:
            state.shadow.clear()  # this step's verify scores the drafts
        if self.tree and any(hasattr(st.drafter, "propose_tree") for st in states):
            return self._step_tree(runner, cache, states)
        drafts = [self._propose(state) for state in states]
        needs_hidden = any(getattr(st.drafter, "needs_hidden", False) for st in states)
        taps = tuple(sorted({i for st in states for i in getattr(st.drafter, "tap_layers", ())}))
        if not needs_hidden and not taps:
            drafts = self._drop_unpaid(states, drafts)
        if not any(drafts) and not needs_hidden and not taps:
            picks = self._plain.step(runner, cache, sequences)
            self._count(picks, [0] * len(picks), states)
            return picks
        proposed = [len(d) for d in drafts]  # the drafters' own tokens, before padding
        drafts = self._pad_drafts(sequences, drafts)
        width = 1 + max(len(d) for d in drafts)
        rows = [
            [seq.output_ids[-1], *d] + [0] * (width - 1 - len(d))
            for seq, d in zip(sequences, drafts, strict=True)
        ]
        lengths = [1 + len(d) for d in drafts]
        model = runner.model
        out = model.forward(mx.array(rows, dtype=mx.int32), cache, lengths=lengths, record=True, taps=taps)
        logits = model.logits(out.hidden).astype(mx.float32)
        normed = model.final_norm(out.hidden) if needs_hidden else None
        argmax = _greedy_picks(states, logits)
        picks: list[list[SampledToken]] = []
        drops: list[int] = []
        for b, (state, draft) in enumerate(zip(states, drafts, strict=True)):
            tokens, accepted = accept_chain(
                state.seq.sampler, draft, logits[b], None if argmax is None else argmax[b]
            )
            picks.append(tokens)
            drops.append(len(draft) - accepted)
            if proposed[b]:  # padding says nothing about the drafter: it is not counted
                state.controller.update(proposed[b], min(accepted, proposed[b]), _run(state))
            state.shadow.verified(proposed[b], min(accepted, proposed[b]))
            if normed is not None or taps:
                kept = accepted + 1
                state.drafter.after_verify(
                    None if normed is None else normed[b, :kept],
                    [t.token_id for t in tokens],
                    {i: out.taps[i][b, :kept] for i in taps},
                )
        cache.rollback(drops)
        self._count(picks, proposed, states)
        return picks

    def _step_tree(
        self, runner: ModelRunner, cache: HybridCache, states: list[_SequenceState]
    ) -> list[list[SampledToken]]:
        """One tree forward for the batch (rows padded with extra leaves under the root, which
        acceptance never considers), then `commit_path` keeps each row's accepted root path."""
        trees = [self._propose_tree(state) for state in states]
        # padded up to a verify width like chains, so a GPU compiles a few tree widths, not one
        # per tree size (the padding leaves are never accepted)
        width = self._width_for(max(len(t) for t in trees))
        rows = [list(t.tokens) + [0] * (width - len(t)) for t in trees]
        parents = [list(t.parents) + [0] * (width - len(t)) for t in trees]
        taps = tuple(sorted({i for st in states for i in getattr(st.drafter, "tap_layers", ())}))
        model = runner.model
        out = model.forward(
            mx.array(rows, dtype=mx.int32), cache, lengths=[len(t) for t in trees], parents=parents, taps=taps
        )
        logits = model.logits(out.hidden).astype(mx.float32)
        needs_hidden = any(getattr(st.drafter, "needs_hidden", False) for st in states)
        normed = model.final_norm(out.hidden) if needs_hidden else None
        mx.eval(logits)
        picks, paths = [], []
        for b, (state, tree) in enumerate(zip(states, trees, strict=True)):
            tokens, path = accept_tree(state.seq.sampler, tree, logits[b])
            picks.append(tokens)
            paths.append(path)
            if len(tree) > 1:
                state.controller.update(max(tree.depths()), len(path) - 1, _run(state))
                state.shadow.verified(max(tree.depths()), len(path) - 1)
            if normed is not None or taps:
                index = mx.array(path, dtype=mx.int32)
                state.drafter.after_verify(
                    None if normed is None else normed[b][index],
                    [t.token_id for t in tokens],
                    {i: out.taps[i][b][index] for i in taps},
                )
        cache.commit_path(paths)
        self._count(picks, [len(t) - 1 for t in trees], states)
        return picks

    def _propose_tree(self, state: _SequenceState) -> DraftTree:
        seq = state.seq
        room = seq.max_tokens - len(seq.output_ids) - 1
        budget = min(
            state.controller.choose(len(seq.output_ids), _run(state)) if self.adaptive else self.max_draft,
            room,
        )
        propose = getattr(state.drafter, "propose_tree", None)
        if propose is not None:
            tree = propose(seq.token_ids, max(budget, 0))
        else:
            tree = DraftTree.chain(
                seq.output_ids[-1], state.drafter.propose(seq.token_ids, max(budget, 0)).tokens
            )
        state.from_prediction = tuple(getattr(state.drafter, "drafted_from_reference", ()))
        return tree

    def _count(
        self, picks: list[list[SampledToken]], proposed: list[int], states: Seq[_SequenceState]
    ) -> None:
        """`proposed`: each row's drafted tokens (padding excluded; an accepted pad counts as
        an emitted token, not as an accepted draft). Each sequence keeps its own counts for its usage,
        and apart from them those of its drafts copied from its predicted output."""
        accepted = [min(len(p) - 1, n) for p, n in zip(picks, proposed, strict=True)]
        s = self.stats
        s.steps += 1
        s.rows += len(picks)
        s.emitted += sum(len(p) for p in picks)
        s.proposed += sum(proposed)
        s.accepted += sum(accepted)
        for state, tokens, n, kept in zip(states, picks, proposed, accepted, strict=True):
            seq = state.seq
            predicted, state.from_prediction = state.from_prediction, ()
            # a chain's draft, or a tree's path: kept as far as the kept tokens follow it
            from_prediction = _shared_prefix(predicted, [t.token_id for t in tokens[:kept]])
            seq.draft_proposed += n
            seq.draft_accepted += kept
            seq.prediction_proposed += len(predicted)
            seq.prediction_accepted += from_prediction
            seq.step_drafts = (kept, from_prediction)  # emit_tokens takes back what a stop cuts off

    def _state(self, seq: Sequence) -> _SequenceState:
        state = self._states.get(id(seq))
        if state is None or state.seq is not seq:
            drafter = self.make_drafter()
            controller = DraftLengthController(max_draft=self.max_draft, cost=self._cost_curve())
            if getattr(drafter, "drafts_on_host", False):
                controller = DraftLengthController(
                    max_draft=self.max_draft,
                    cost=self._cost_curve(),
                    prior=HOST_DRAFTER_PRIOR,
                    decay=HOST_DRAFTER_DECAY,
                )
            state = _SequenceState(
                seq, drafter, controller, exit_cost=PIPELINE_EXIT_COST_GPU if backend() else 0.0
            )
            self._states[id(seq)] = state
            if seq.prediction_ids and hasattr(drafter, "add_reference"):
                # the request's other choices read the same prediction: its index is built once
                like = next(
                    (
                        st.drafter
                        for st in self._states.values()
                        if st is not state and st.seq.prediction_ids is seq.prediction_ids
                    ),
                    None,
                )
                drafter.add_reference(seq.prediction_ids, like=like)
            _hand_prompt_tail(seq, drafter)
        return state

    def _cost_curve(self) -> list[float]:
        if self.cost_curve is not None:
            return list(self.cost_curve)
        return (gpu_cost_curve if backend() else default_cost_curve)(self.max_draft)

    def forget(self, sequences: Seq[Sequence]) -> None:
        """Drop these sequences' drafters (their batch step failed; each resumes with a new one)."""
        for seq in sequences:
            self._states.pop(id(seq), None)

    def _forget_finished(self, sequences: Seq[Sequence]) -> None:
        states = self._states
        if len(states) == len(sequences) and all(states.get(id(s)) is not None for s in sequences):
            return  # every state is a live sequence's: nothing to forget (the per-step case)
        live = {id(seq) for seq in sequences}
        for key in [k for k, st in states.items() if k not in live and st.seq.is_finished]:
            del states[key]

    def _propose(self, state: _SequenceState) -> list[int]:
        seq = state.seq
        if not seq.output_ids:
            return []
        state.from_prediction = ()
        room = seq.max_tokens - len(seq.output_ids) - 1  # the target adds one token of its own
        depth = _run(state)
        k = min(
            state.controller.choose(len(seq.output_ids), depth) if self.adaptive else self.max_draft, room
        )
        state.probing = (
            self.adaptive and not state.on_host and k > 0 and state.controller.best_length(depth) == 0
        )
        if k <= 0 and not getattr(state.drafter, "needs_hidden", False):
            return []
        if k > 0 and getattr(state.drafter, "extends_free", False):
            k = min(self._width_for(1 + k) - 1, room)  # the padding's places, filled by real drafts
        draft = list(state.drafter.propose(seq.token_ids, max(k, 0)).tokens)
        state.from_prediction = tuple(getattr(state.drafter, "drafted_from_reference", ()))
        return draft

    @property
    def padded_widths(self) -> tuple[int, ...]:
        """The verify widths drafts are padded up to here (none: every width as it comes)."""
        return self._widths()

    def _widths(self) -> tuple[int, ...]:
        widths = self.verify_widths
        if widths is None:
            widths = GPU_VERIFY_WIDTHS if backend() else ()
        return verify_widths(widths, self.max_draft)

    def _width_for(self, width: int, widths: tuple[int, ...] | None = None) -> int:
        """The verify width a forward of `width` tokens is padded up to (`widths`: `_widths()`)."""
        return width_for(width, self._widths() if widths is None else widths)

    def _pad_drafts(self, sequences: Seq[Sequence], drafts: list[list[int]]) -> list[list[int]]:
        return pad_drafts(sequences, drafts, self._widths())


def _hand_prompt_tail(seq: Sequence, drafter: Drafter) -> None:
    """Give a new sequence's drafter the prompt's last positions as if a verify had kept them:
    their rows, and the token that followed each (the prompt's next, then the first output)."""
    tail, seq.prompt_tail = seq.prompt_tail, None
    if tail is None or not tail.length or tail.start + tail.length != seq.num_prompt_tokens:
        return  # no rows, or rows that do not end where the output starts
    if len(seq.output_ids) != 1:
        return  # the sequence has moved past where they line up
    drafter.after_verify(tail.normed, tail.next_tokens(seq.prompt_ids, seq.output_ids[0]), tail.taps)


def _shared_prefix(a: Seq[int], b: Seq[int]) -> int:
    n = min(len(a), len(b))
    return next((i for i in range(n) if a[i] != b[i]), n)


def _run(state: _SequenceState) -> int:
    """The depth a host drafter's next draft continues from (its correct tokens in a row); other
    drafters' depths count from each draft's start."""
    return state.shadow.run if state.on_host else 0


def _greedy_picks(states: list[_SequenceState], logits: mx.array) -> list[list[int]] | None:
    """Evaluate the verify forward. When every row is bare greedy, only its argmax ids come back
    (one device round trip for the step, and no [B, T, V] float32 logits kept); else the logits."""
    if all(is_plain_greedy(st.seq.sampler) for st in states):
        return mx.argmax(logits, axis=-1).tolist()
    mx.eval(logits)
    return None
