"""The study's chain: which proposers and screens a run asks, in which order.

One place says the order of the decision chain (:mod:`tuner.study.decide`): the planner's
proposers (the structural levers' rungs on the best flags, the SLO bracket, the memory frontier, the cache candidate, the noise repeat), the
screens every asked trial passes (the two proofs, a structural lever this deployment cannot take, a failed quality gate of the same numerics, the host's memory), those a sampled config passes
(the proofs, the models' predictions, the host's memory), and the sampler, which also skips a config
another host runs now.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from tuner.config import TunerConfig
from tuner.sglang.flags import FlagTable, parse_argv
from tuner.sglang.hicache import HostMemory as HostReading
from tuner.study.decide import Decider, Draw, Proposer, Screen
from tuner.study.decide.cache import CacheCandidate
from tuner.study.decide.memory import MemoryFrontier
from tuner.study.decide.repeat import NoiseRepeat
from tuner.study.decide.rungs import RungCandidate, RungPrices
from tuner.study.decide.sampler import ProposalMirror, Sampler
from tuner.study.decide.screens import (
    HostMemory,
    MeasuredAlready,
    MustFail,
    Predicted,
    QualityFailed,
    RunningElsewhere,
    Unavailable,
    WontStart,
)
from tuner.study.decide.slo import SLOBracket
from tuner.study.decide.speculative import SpeculativeRules, SpeculativeShapes
from tuner.study.lever_space import study_model

__all__ = ["build_chain"]


def build_chain(config: TunerConfig, mirror: ProposalMirror, *, read_host: Callable[[], HostReading | None],
                version: str, argv: Sequence[str], use_planner: bool,
                on_skip: Callable[[Draw], bool], gpu: str | None = None) -> tuple[Decider, Sampler]:
    """The decider and the sampler of one run.

    Args:
        config: The config (``[objective]``, ``[study] predicted_candidates``).
        mirror: The sampler's in-memory mirror of the study.
        read_host: Reads this host's memory before a launch (the host-memory screen).
        version: The SGLang version (the hierarchical cache's defaults).
        argv: The service's command line (its ranks, ``--page-size``).
        use_planner: Ask the planner's proposers and the predicted screen (off: the sampler
            alone, the search-quality benchmark's comparison).
        on_skip: Records a sampler's rejected draw; returns whether the run goes on.
        gpu: The GPU's name (the structural rungs' feasibility cells and prices).
    """
    objective = config.objective
    host = HostMemory(read_host, version, argv)
    rules = SpeculativeRules(version, argv)
    prices = RungPrices(version, argv, study_model(config, parse_argv(list(argv), FlagTable.for_version(version))), gpu)
    proofs: list[Screen] = [MeasuredAlready(reprobe=config.quality.enabled), MustFail(), Unavailable(version, argv),
                            WontStart(prices), rules, QualityFailed()]
    sampled: list[Screen] = [*proofs, *([Predicted()] if use_planner else []), host]
    planned: list[Proposer] = [RungCandidate(objective, prices), SLOBracket(), CacheCandidate(objective, host, early=True),
                               MemoryFrontier(), SpeculativeShapes(rules), CacheCandidate(objective, host),
                               NoiseRepeat(objective)]
    decider = Decider(planned if use_planner else [], [*proofs, host], sampled, config.study.predicted_candidates)
    return decider, Sampler(mirror, [*sampled, RunningElsewhere()], on_skip)
