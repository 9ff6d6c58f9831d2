"""Search strategies: how the candidate units are turned into the smallest plan that meets the target.

Each strategy is a function over :class:`~qdebug.propose.search.Search` (the
budget, the cache and the trace) and :class:`~qdebug.propose.search.Plan`
values; it scores plans with :func:`~qdebug.propose.search.evaluate_plan`
and stops when ``search.left`` is spent. :func:`run_search` runs them in
order:

1. the baseline, then (where analyze measured the integer kernels saturating at several nodes) 7-bit weights
   for the whole model, then per-channel weights alone (the cheapest change), then (``--allow calib-flipped``)
   every range the static model's flipped evaluation samples widen (:mod:`qdebug.propose.flipped`);
2. growth (:func:`_grow`): the ranked units are bisected (monotone prefix
   search); when even all of them miss the target, the search turns greedy --
   it adopts the shortest prefix that captures half of their gain
   (:func:`_gallop`), *re-ranks given what is already excluded* and repeats
   until the target is met or the gain stalls. If ``--max-nodes`` blocks it,
   the growth is retried without the cap (pruning often brings the result
   under it); if the blamed units cannot reach the target at all, once more
   over every quantized tensor (:func:`_exclusions`);
3. refinement: units, then single nodes, then pairs of nodes that turn out
   unnecessary are pruned (:func:`_prune`); FP32 units are replaced by
   16-bit activations where the target still holds (:func:`_cheapen`) and
   16-bit tensors pruned (:func:`_prune_overrides`); units the ranking never
   blamed are tried alone (:func:`_single_unit`).

The cheapest option that meets the target is kept: per-channel < int16 < fp32.

**Rounds.** The strategies are sequential decisions, each step choosing the next candidate from the
last scores. Where a step's candidates do not depend on each other's scores (leave-one-out in
:func:`_scores_without`) they are one round of :meth:`~qdebug.propose.search.Search.evaluate_many`; before
every other step the candidates that may come next are hinted (:meth:`~qdebug.propose.search.Search.prefetch`:
both halves of a bisection step, QuickXplain's next test either way, a unit's fixes, the pairs, the units
tried alone) and scored by idle workers. Both give the trace and the budget of the plain sequential run, for
any number of workers: the rounds are made of the strategy's own candidates, never of how many workers there
are, and a hint only moves work earlier.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

from qdebug.propose.blame import Unit
from qdebug.propose.minimize import minimal_subset
from qdebug.propose.search import Fix, Plan, Rerank, Search, Trial, evaluate_plan, plan_ask
from qdebug.vocabulary import FIX_KINDS as FIX_KINDS_ALL

BEFORE_PER_CHANNEL = frozenset(k for k, f in FIX_KINDS_ALL.items() if f.whole_first)
"""Whole-model fixes tried before per-channel weights: 7-bit weights are offered only where analyze measured
the integer kernels saturating at several nodes, which per-channel scales do not cure (they widen each
channel's codes to the full 8 bits); trying them first saves a build and an evaluation where they are the
answer (the 3,200-node benchmark chain without VNNI: propose in 2 evaluations and 19.7 s, not 3 and 36.4 s)."""


def run_search(
    search: Search,
    initial: list[Unit],
    rerank: Rerank,
    max_nodes: int | None,
    widened: list[Unit] | None = None,
    diagnosed: Sequence[Unit] = (),
    fixer: Fixer | None = None,
    wholes: Sequence[Fix] = (),
) -> tuple[Plan, Trial | None, int]:
    """Baseline, per-channel, the whole-model fixes, diagnoses, then grow / minimize / cheapen; returns
    (plan, met trial or None, re-ranks).

    ``wholes`` (7-bit weights for every weighted node where analyze measured the integer kernels' gap at
    several; with ``--allow calib-flipped``, every range the flipped samples widen) are one evaluation each,
    in order; the first that meets the target is the answer (no node kept FP32), else the search goes on
    without them and their per-unit forms are tried on the answer's units like the other fixes. The kinds in
    :data:`BEFORE_PER_CHANNEL` are tried before per-channel weights, the others after.

    The ``diagnosed`` units (:mod:`qdebug.propose.diagnose`) are tried together before any growth: when
    they meet the target the answer is minimized from them alone; else they lead the ranking.

    Per-channel weights alone are tried first (the cheapest change). When they
    do not meet the target, the exclusions are searched *without* them: adopted
    as soon as they helped a little, they had steered the search to larger
    sets (7 nodes at 91.0 % where 2 nodes give 92.4 % without). Only when that
    search fails, and per-channel helped, is it run again with per-channel on.
    """
    early = [w for w in wholes if w.kind in BEFORE_PER_CHANNEL]
    late = [w for w in wholes if w.kind not in BEFORE_PER_CHANNEL]
    _hint_start(search, diagnosed, early, late)
    base = search.evaluate("baseline", ())
    assert base is not None
    if base.met:
        return Plan(), base, 0
    tried: list[tuple[Fix, Trial]] = []
    answer = _first_whole_met(search, early, tried)
    if answer is not None:
        return answer
    if early:  # the rest, hinted only now: built ahead, they had cost re-quantization an early answer spares
        _hint_start(search, diagnosed, [], late, baseline=False)
    pc_helped: Trial | None = None
    if "per-channel" in search.allow and not search.per_channel:
        pc = search.evaluate("per-channel", (), per_channel=True)
        if pc is not None and pc.met:
            search.per_channel = True
            return Plan(), pc, 0
        if pc is not None and search.score(pc) > search.score(base) + search.target.noise:
            pc_helped = pc
    answer = _first_whole_met(search, late, tried)
    if answer is not None:
        return answer
    if not {"fp32", "int16"} & set(search.allow):  # the best whole-model fix kept so the best trial names it
        best = max(tried, key=lambda ft: search.score(ft[1]), default=None)
        return Plan(fixed=(best[0],) if best is not None else ()), None, 0
    action = "fp32" if "fp32" in search.allow else "int16"
    cap = max_nodes if action == "fp32" else None
    diagnosis = _diagnosed(search, diagnosed, action)
    if diagnosis is not None:
        search.held = 0
        plan, met = _refined(search, *diagnosis, action, reserve=0, fixer=fixer)
        return plan, met, 0
    first = [u.nodes for u in diagnosed]
    initial = [*diagnosed, *(u for u in initial if u.nodes not in first)]
    plan, met, reranks = _exclusions(search, initial, rerank, action, cap, base, widened)
    if met is None and pc_helped is not None and search.left > 0:
        search.per_channel = True
        plan, met, more = _exclusions(search, initial, rerank, action, cap, pc_helped, widened)
        reranks += more
    singles = action == "fp32" and bool(widened)
    search.held = 0  # the evaluations held back are for the refinement below
    if met is not None:  # the pairs leave the single-unit tries their budget
        reserve = SINGLE_TRIES if singles else 0
        plan, met = _refined(search, plan, met, action, reserve=reserve, fixer=fixer)
    if singles and widened and search.left > 0:
        plan, met = _smaller_single(search, plan, met, initial, widened, cap)
    return plan, met, reranks


def _first_whole_met(
    search: Search, wholes: Sequence[Fix], tried: list[tuple[Fix, Trial]]
) -> tuple[Plan, Trial, int] | None:
    """Each whole-model fix in order, one evaluation each (appended to ``tried``); the first that meets the
    target as :func:`run_search`'s answer, or None."""
    for whole in wholes:
        trial = evaluate_plan(search, f"whole {whole.kind}", Plan(fixed=(whole,)))
        if trial is not None and trial.met:
            return Plan(fixed=(whole,)), trial, 0
        if trial is not None:
            tried.append((whole, trial))
    return None


def _hint_start(
    search: Search,
    diagnosed: Sequence[Unit],
    early: Sequence[Fix],
    late: Sequence[Fix],
    baseline: bool = True,
) -> None:
    """The first evaluations, likely all made: full static, the whole-model fixes tried before per-channel,
    per-channel weights, the other whole-model fixes, the diagnoses together. With fixes tried before
    per-channel only they are hinted (with the baseline): one of them is often the answer."""
    hints = [search.ask(())] if baseline else []
    hints.extend(plan_ask(search, Plan(fixed=(whole,))) for whole in early)
    if not early:
        if "per-channel" in search.allow and not search.per_channel:
            hints.append(search.ask((), per_channel=True))
        hints.extend(plan_ask(search, Plan(fixed=(whole,))) for whole in late)
        if diagnosed and ("fp32" in search.allow or "int16" in search.allow):
            hints.append(plan_ask(search, Plan().with_units(diagnosed, "fp32" if "fp32" in search.allow else "int16")))
    search.prefetch(hints)


def _hint_prefixes(search: Search, plan: Plan, cands: Sequence[Unit], action: str, sizes: Sequence[int]) -> None:
    """Hint ``plan`` plus each of the first ``sizes`` candidates (what a bisection or a gallop asks next)."""
    hints = [plan_ask(search, plan.with_units(cands[:k], action)) for k in dict.fromkeys(sizes) if 0 < k]
    search.prefetch(hints)


def _probes(lo: int, hi: int, depth: int) -> list[int]:
    """The prefix lengths :func:`_bisect` over (lo, hi] may score in its next ``depth`` steps, breadth first
    (this step's first, then the next one's if it meets the target, then if it does not)."""
    out, level = [], [(lo, hi)]
    for _ in range(depth):
        nxt = []
        for a, b in level:
            if b - a > 1:
                m = (a + b) // 2
                out.append(m)
                nxt += [(a, m), (m, b)]
        level = nxt
    return out


def _diagnosed(search: Search, diagnosed: Sequence[Unit], action: str) -> tuple[Plan, Trial] | None:
    """The diagnosed units together, when they meet the target (one evaluation); else ``None``."""
    if not diagnosed:
        return None
    plan = Plan().with_units(diagnosed, action)
    trial = evaluate_plan(search, "diagnosis", plan)
    return (plan, trial) if trial is not None and trial.met else None


Fixer = Callable[[Unit, str], Fix | None]
"""The per-node fix of a kind for a unit, or None where it does not apply (:mod:`qdebug.propose.fixes`)."""

FIX_KINDS = tuple(k for k, f in FIX_KINDS_ALL.items() if f.per_unit)
"""The per-node fixes in the order tried: ``calib-flipped`` last, as its recovery is measured on the samples
its ranges come from (an upper bound), so a fix without that caveat is preferred where one suffices."""

SINGLE_TRIES = 4
"""Units outside the blamed ranking tried alone after the search (one evaluation each)."""


def _refined(
    search: Search,
    plan: Plan,
    met: Trial,
    action: str,
    reserve: int,
    fixer: Fixer | None = None,
) -> tuple[Plan, Trial]:
    """A met plan made smaller and cheaper: minimized, FP32 units kept INT8 by a per-node fix where one
    suffices, then turned 16-bit when allowed, 16-bit tensors pruned; ``reserve`` evaluations are left for
    the single-unit tries after it."""
    plan, met = _prune(search, plan, action, met, reserve=reserve)
    kinds = [k for k in FIX_KINDS if k in search.allow]
    if action == "fp32" and fixer is not None and kinds:
        plan, met = _fix_cheaper(search, plan, met, kinds, fixer)
    if action == "fp32" and "int16" in search.allow:
        plan, met = _cheapen(search, plan, met)
    if plan.int16:
        plan, met = _prune_overrides(search, plan, met)
    return plan, met


def _smaller_single(
    search: Search,
    plan: Plan,
    met: Trial | None,
    initial: list[Unit],
    widened: list[Unit],
    cap: int | None,
) -> tuple[Plan, Trial | None]:
    """The answer replaced by one unblamed unit that meets the target alone, when the answer misses or keeps
    several nodes; else the answer unchanged (see :func:`_single_unit`)."""
    answered = met is not None and search.fits(met)
    if answered and len(plan.nodes()) <= 1:
        return plan, met
    # smaller than the answer (a region of an unblamed tensor can hold several nodes), within the cap
    room = len(met.nodes) - 1 if answered and met is not None else cap
    blamed = {u.nodes for u in initial}
    unblamed = [u for u in widened if u.nodes not in blamed][:SINGLE_TRIES]
    single = _single_unit(search, unblamed, room)
    return single if single is not None else (plan, met)


def _exclusions(
    search: Search,
    initial: list[Unit],
    rerank: Rerank,
    action: str,
    cap: int | None,
    cur: Trial,
    widened: list[Unit] | None,
) -> tuple[Plan, Trial | None, int]:
    """Grow a plan from ``cur``: within ``cap`` first; if that fails, without the cap (pruning often brings a
    larger answer under it); if the blamed units cannot reach the target at all, over ``widened`` (every
    quantized tensor)."""
    plan, met, reranks = _grow(search, initial, rerank, action, cap, cur)
    if met is None and cap is not None and search.left > 0:
        plan, met, more = _grow(search, initial, rerank, action, None, cur)
        reranks += more
    if met is None and widened and search.left > 0:
        plan, met, more = _grow(search, widened, rerank, action, None, cur, widen=True)
        reranks += more
    return plan, met, reranks


def _single_unit(search: Search, ranking: list[Unit], cap: int | None) -> tuple[Plan, Trial] | None:
    """The first unit of ``ranking`` that meets the target alone, within the budget left; ``None`` if none.

    The ranking blames nodes by the error they *introduce*; a node after an
    averaging step (a pooled Gemm head) introduces less than nothing although
    its own weights and Q/DQ limit the output, so the growth never tries it.
    On a 1-D conv model the search kept 4 of 6 nodes FP32 for 43 dB, and
    reported the target missed with ``--max-nodes 1``, while the Gemm alone
    gave 43.2 dB. So after the search, when its answer has several nodes or
    misses, the first :data:`SINGLE_TRIES` units it never blamed (worst local
    SQNR first) are tried alone.
    """
    tried = [u for u in ranking if cap is None or len(u.nodes) <= cap]
    search.prefetch([plan_ask(search, Plan().with_units([u], "fp32")) for u in tried])
    for u in ranking:
        if search.left <= 0:
            return None
        if cap is not None and len(u.nodes) > cap:
            continue
        plan = Plan().with_units([u], "fp32")
        trial = evaluate_plan(search, "single", plan)
        # the nodes scored, not the unit's: closing a leak can add a consumer to the unit's list
        if trial is not None and trial.met and search.fits(trial) and (cap is None or len(trial.nodes) <= cap):
            return plan, trial
    return None


def _grow(
    search: Search,
    ranking: list[Unit],
    rerank: Rerank,
    action: str,
    cap: int | None,
    cur: Trial,
    widen: bool = False,
) -> tuple[Plan, Trial | None, int]:
    """Bisect the ranked units; when all of them miss the target, adopt the gain and re-rank (greedy)."""
    plan = Plan()
    reranks = 0
    reranked_for: Plan | None = None
    while search.left > 0:
        cands: list[Unit] = []
        for u in ranking:
            trial_plan = plan.with_units([*cands, u], action)
            if cap is not None and len(trial_plan.nodes()) > cap and action == "fp32":
                room = cap - len(plan.with_units(cands, action).nodes())
                if room <= 0:
                    continue
                u = _cut_to(u, room)  # a region over the cap: where it starts may fit and help alone
                trial_plan = plan.with_units([*cands, u], action)
            if not _covers(plan.with_units(cands, action), u, action) and (
                cap is None or len(trial_plan.nodes()) <= cap
            ):
                cands.append(u)
        if cands:  # then a bisection (met) or a gallop (a gain): their first steps hinted
            _hint_prefixes(search, plan, cands, action, [len(cands), *_probes(0, len(cands), search.hint_depth), 1])
            full = evaluate_plan(search, "candidates", plan.with_units(cands, action))
            if full is None:
                break
            if full.met:
                k = _bisect(search, plan, cands, action, len(cands))
                plan = plan.with_units(cands[:k], action)
                return plan, evaluate_plan(search, "bisect", plan) or full, reranks
            gain = search.score(full) - search.score(cur)
            if gain > search.target.noise:
                k, trial = _gallop(search, plan, cands, action, search.score(cur) + gain / 2, full)
                plan, cur = plan.with_units(cands[:k], action), trial
                if trial.met:
                    return plan, trial, reranks
                reranked_for = None  # progress: the ranking is re-made for the new plan below
        if reranked_for == plan:
            break  # nothing left to try, or stalled even after re-ranking
        ranking = rerank(plan, widen)
        reranks += 1
        reranked_for = plan
    return plan, None, reranks


def _covers(plan: Plan, u: Unit, action: str) -> bool:
    """True when ``u`` adds nothing to ``plan`` under ``action``."""
    if action == "fp32":
        return set(u.nodes) <= plan.nodes()
    return set(u.tensors) <= ({t for x in plan.int16 for t in x.tensors} | plan.nodes_tensors())


def _cut_to(u: Unit, room: int) -> Unit:
    """``u`` cut to its first ``room`` nodes (topological order: where the float region starts), for a
    ``--max-nodes`` cap its whole region does not fit.

    The cap had dropped such regions whole: on the transformer fixture with
    ``--max-nodes 1`` the proposal was empty (83.6 %), while keeping the
    region's first node, the embedding Add, in FP32 gives 92.4 %.
    """
    if len(u.nodes) <= room:
        return u
    nodes = u.nodes[:room]
    why = f"{u.why}; cut to {', '.join(nodes)} to fit --max-nodes"
    return dataclasses.replace(u, key=f"node:{nodes[0]}", kind="node", nodes=nodes, tensors=(), why=why)


def _bisect(search: Search, plan: Plan, cands: list[Unit], action: str, hi: int, lo: int = 0) -> int:
    """Smallest prefix length in (lo, hi] that meets the target (``hi`` is known to meet it)."""
    while hi - lo > 1 and search.left > 0:
        mid = (lo + hi) // 2
        _hint_prefixes(search, plan, cands, action, _probes(lo, hi, search.hint_depth))  # this step, the next ones
        t = evaluate_plan(search, "bisect", plan.with_units(cands[:mid], action))
        if t is None:
            break
        if t.met:
            hi = mid
        else:
            lo = mid
    return hi


def _gallop(
    search: Search, plan: Plan, cands: list[Unit], action: str, wanted: float, full: Trial
) -> tuple[int, Trial]:
    """Smallest prefix 1, 2, 4, ... reaching ``wanted`` (half the gain of all candidates), or all of them."""
    k = 1
    while k < len(cands) and search.left > 0:
        nxt = 2 * k if 2 * k < len(cands) else 0
        _hint_prefixes(search, plan, cands, action, [k, nxt, (k // 2 + k) // 2 if k - k // 2 > 1 else 0])
        t = evaluate_plan(search, "gallop", plan.with_units(cands[:k], action))
        if t is None:
            break
        if t.met:
            k2 = _bisect(search, plan, cands, action, k, k // 2)
            return k2, evaluate_plan(search, "bisect", plan.with_units(cands[:k2], action)) or t
        if search.score(t) >= wanted:
            return k, t
        k *= 2
    return len(cands), full


def _prune(search: Search, plan: Plan, action: str, met: Trial, reserve: int = 0) -> tuple[Plan, Trial]:
    """Shrink a met plan by group testing: to a minimal list of units, then (FP32) a minimal list of nodes,
    then pairs of nodes that only go together (:func:`~qdebug.propose.minimize.minimal_subset`).

    ``reserve`` evaluations are left for what comes after.
    """

    def units_meet(units: list[Unit]) -> bool | None:
        if search.left <= reserve:
            return None
        t = evaluate_plan(search, "minimize", Plan().with_units(units, action))
        return None if t is None else t.met

    def units_ahead(subsets: list[list[Unit]]) -> None:
        search.prefetch([plan_ask(search, Plan().with_units(u, action)) for u in subsets])

    units, _ = minimal_subset(list(plan.units()), units_meet, units_ahead, search.hint_depth)
    plan = Plan().with_units(units, action)
    met = evaluate_plan(search, "minimize", plan) or met  # scored during the minimization: cached
    if action != "fp32":
        return plan, met

    def nodes_meet(nodes: list[str]) -> bool | None:
        if search.left <= reserve:
            return None
        t = search.evaluate("minimize", nodes)
        return None if t is None else t.met

    # a unit's members go in its order (producer first), the units in the plan's (likeliest culprits first)
    nodes = list(dict.fromkeys(n for u in units for n in u.nodes if n in met.nodes))
    nodes += [n for n in met.nodes if n not in nodes]  # consumers added to close a leak
    kept, _ = minimal_subset(
        nodes, nodes_meet, lambda subsets: search.prefetch([search.ask(n) for n in subsets]), search.hint_depth
    )
    dropped = set(nodes) - set(kept)
    alone = _scores_without(search, kept, reserve)
    dropped |= _prune_pairs(search, kept, alone, reserve)
    if dropped:
        met = search.evaluate("minimize", [n for n in nodes if n not in dropped]) or met
        smaller = [dataclasses.replace(u, nodes=tuple(x for x in u.nodes if x not in dropped)) for u in units]
        plan = Plan(fp32=tuple(u for u in smaller if u.nodes))
    return plan, met


def _scores_without(search: Search, nodes: list[str], reserve: int) -> dict[str, float]:
    """The score without each node, for an answer small enough to prune by pairs (mostly cached: the
    minimization's last steps scored these sets)."""
    if not 3 <= len(nodes) <= PAIR_PRUNE_MAX_NODES:
        return {}
    asked = [search.ask([m for m in nodes if m != n]) for n in nodes]
    trials = search.evaluate_many("minimize", asked, reserve=reserve)  # one round: independent of each other
    return {n: search.score(t) for n, t in zip(nodes, trials, strict=True) if t is not None}


PAIR_PRUNE_MAX_NODES = 8
"""Answers up to this size are also pruned by pairs (at most 28 evaluations, within the budget)."""
PAIRS_AHEAD = 3
"""Pairs hinted beyond the one about to be scored (as if it and they all fail)."""


def _prune_pairs(search: Search, nodes: list[str], alone: dict[str, float], reserve: int = 0) -> set[str]:
    """Nodes that can go two at a time although neither can go alone.

    Two branches feeding one Concat: keeping either one FP32 leaves the Concat
    mixing a float and a quantized input, and the target is missed, while
    dropping both meets it (review: 5 nodes proposed where 3 meet the same
    target, and --max-nodes 3 reported as missed). Pairs are tried in the
    order of how close each node's removal alone came to the target
    (``alone``: the score without it), so the budget goes to the likely ones
    first; each success is kept and the pairs go on from there. ``reserve``
    evaluations are left for what comes after.
    """
    if len(nodes) < 3 or len(nodes) > PAIR_PRUNE_MAX_NODES:
        return set()
    near = sorted((n for n in nodes if n in alone), key=lambda n: -alone[n])
    pairs = sorted(
        ((a, b) for i, a in enumerate(near) for b in near[i + 1 :]), key=lambda p: -(alone[p[0]] + alone[p[1]])
    )
    dropped: set[str] = set()
    for i, (a, b) in enumerate(pairs):
        if search.left <= reserve:
            break
        if a in dropped or b in dropped or len(nodes) - len(dropped) <= 2:
            continue
        ahead = [(x, y) for x, y in pairs[i : i + 1 + PAIRS_AHEAD] if x not in dropped and y not in dropped]
        search.prefetch([search.ask([n for n in nodes if n not in dropped | {x, y}]) for x, y in ahead])
        trial = search.evaluate("prune", [n for n in nodes if n not in dropped | {a, b}])
        if trial is not None and trial.met:
            dropped |= {a, b}
    return dropped


def _fix_cheaper(
    search: Search, plan: Plan, met: Trial, kinds: Sequence[str], fixer: Fixer
) -> tuple[Plan, Trial]:
    """Keep each FP32 unit INT8 with the first fix of ``kinds`` (cheapest first) that still meets the
    target, one unit at a time (last first); a fix that does not apply costs no evaluation."""
    for u in reversed(plan.fp32):
        fixes = [f for f in (fixer(u, kind) for kind in kinds) if f is not None]
        search.prefetch([plan_ask(search, _fixed(plan, u, f)) for f in fixes])  # the unit's fixes, cheapest first
        for kind in kinds:
            if search.left <= 0:
                return plan, met
            fix = fixer(u, kind)
            if fix is None:
                continue
            candidate = _fixed(plan, u, fix)
            trial = evaluate_plan(search, f"fix {kind}", candidate)
            if trial is not None and trial.met:
                plan, met = candidate, trial
                break
    return plan, met


def _fixed(plan: Plan, u: Unit, fix: Fix) -> Plan:
    """``plan`` with the FP32 unit ``u`` kept INT8 by ``fix`` instead."""
    return Plan(tuple(x for x in plan.fp32 if x is not u), plan.int16, (*plan.fixed, fix))


def _int16(plan: Plan, u: Unit) -> Plan:
    """``plan`` with the FP32 unit ``u`` given 16-bit activations instead."""
    return Plan(tuple(x for x in plan.fp32 if x is not u), plan.int16 + (u,), plan.fixed)


def _cheapen(search: Search, plan: Plan, met: Trial) -> tuple[Plan, Trial]:
    """Replace FP32 units by 16-bit activations where the target still holds (weights stay 8-bit).

    All units at once first (one evaluation); then, budget allowing, one unit at
    a time from the least important.
    """
    if search.left <= 0 or not plan.fp32:
        return plan, met
    every = Plan(int16=plan.fp32, fixed=plan.fixed)
    units = list(reversed(plan.fp32))
    search.prefetch([plan_ask(search, p) for p in (every, *(_int16(plan, u) for u in units[:PAIRS_AHEAD]))])
    t = evaluate_plan(search, "int16", every)
    if t is not None and t.met:
        return every, t
    if len(plan.fp32) == 1:
        return plan, met
    for i, u in enumerate(units):
        if search.left <= 0:
            break
        search.prefetch([plan_ask(search, _int16(plan, v)) for v in units[i : i + 1 + PAIRS_AHEAD]])
        mixed = _int16(plan, u)
        t = evaluate_plan(search, "int16", mixed)
        if t is not None and t.met:
            plan, met = mixed, t
    return plan, met


def _prune_overrides(search: Search, plan: Plan, met: Trial) -> tuple[Plan, Trial]:
    """Drop 16-bit tensors the target turns out not to need, one at a time (last first).

    A unit turned 16-bit carries every tensor of its region (an attention block: 5), where one is often
    enough (review: 16-bit on the scores alone gave 92.6 % where all five gave 91.8 %).
    """
    tensors = sorted(plan.overrides(), key=lambda t: [t in u.tensors for u in plan.int16].index(True))
    if len(tensors) <= 1:
        return plan, met
    dropped: set[str] = set()
    order = list(reversed(tensors))
    for i, t in enumerate(order):
        if search.left <= 0 or len(tensors) - len(dropped) <= 1:
            break
        ahead = [[x for x in tensors if x not in dropped and x != y] for y in order[i : i + 1 + PAIRS_AHEAD]]
        search.prefetch([search.ask(plan.nodes(), k, keep_float=plan.keep_float(), fixes=plan.fixes()) for k in ahead])
        keep = [x for x in tensors if x not in dropped and x != t]
        trial = search.evaluate("prune", plan.nodes(), keep, keep_float=plan.keep_float(), fixes=plan.fixes())
        if trial is not None and trial.met:
            dropped.add(t)
            met = trial
    if not dropped:
        return plan, met
    int16 = tuple(dataclasses.replace(u, tensors=tuple(x for x in u.tensors if x not in dropped)) for u in plan.int16)
    return Plan(plan.fp32, tuple(u for u in int16 if u.tensors), plan.fixed), met
