"""The predictor's answers as the search uses them: every candidate predicted, unusable answers
set aside with one warning per kind, a learning predictor told each measurement."""

from __future__ import annotations

import logging
import math
from typing import Any, Dict, List, Optional, Set, Tuple

from atorch.auto.search.results import LearningPredictorLike, Predictor
from atorch.auto.search.space import Candidate
from atorch.auto.strategy import Strategy

logger = logging.getLogger(__name__)

def predicted_peaks(predictions: List[Any]) -> Optional[List[Optional[float]]]:
    if not predictions or any(p is None for p in predictions):
        return None
    return [float(p.peak_memory_bytes) for p in predictions]


def observe(learner: LearningPredictorLike, strategy: Strategy, step_time_s: float) -> bool:
    try:
        learner.observe(strategy, step_time_s)
        return True
    except Exception as e:  # noqa: BLE001 - a predictor that cannot learn is still a predictor
        logger.warning("the predictor could not learn from %s (%s); its predictions stay as they were",
                       strategy.describe(), e)
        return False


def predict_all(predictor: Optional[Predictor], candidates: List[Candidate], warned: Set[str]) -> List[Any]:
    """Every candidate's prediction; None where the predictor raised or answered something
    unusable (one warning per kind of problem and search, naming the first candidate and the count)."""
    if predictor is None:
        return [None] * len(candidates)
    out: List[Any] = []
    problems: Dict[str, Tuple[str, int]] = {}
    for c in candidates:
        prediction, problem = predict_one(predictor, c.strategy)
        out.append(prediction)
        if problem is not None:
            kind, detail = problem
            first, count = problems.get(kind, (f"{c.strategy.describe()}: {detail}", 0))
            problems[kind] = (first, count + 1)
    for kind, (first, count) in problems.items():
        if kind not in warned:
            warned.add(kind)
            logger.warning("the predictor gave no usable prediction for %d of %d candidates (e.g. %s); they are "
                           "searched without one", count, len(candidates), first)
    return out


def predict_one(predictor: Predictor, strategy: Strategy) -> Tuple[Any, Optional[Tuple[str, str]]]:
    """(prediction, None) or (None, (kind of problem, what was wrong))."""
    try:
        prediction = predictor(strategy)
    except Exception as e:  # noqa: BLE001 - an unpredictable candidate is still searchable
        return None, ("raised", f"raised {type(e).__name__} ({e})")
    problem = invalid_prediction(prediction)
    return (None, problem) if problem is not None else (prediction, None)


def invalid_prediction(prediction: Any) -> Optional[Tuple[str, str]]:
    """(kind, what) when a predictor's answer cannot be used, None when it can: it needs a
    finite positive step time and a finite non-negative peak memory."""
    try:
        step, peak = float(prediction.step_time_s), float(prediction.peak_memory_bytes)
    except (AttributeError, TypeError, ValueError) as e:
        return "type", f"an object without numeric step_time_s / peak_memory_bytes ({type(prediction).__name__}: {e})"
    if not (math.isfinite(step) and step > 0):
        return "step_time_s", f"step_time_s={step!r}"
    if not (math.isfinite(peak) and peak >= 0):
        return "peak_memory_bytes", f"peak_memory_bytes={peak!r}"
    return None


def predicted_prior(predictions: List[Any]) -> Optional[List[float]]:
    """Predicted log-throughput of every candidate (up to a constant), or None unless all are predicted."""
    if not predictions or any(p is None for p in predictions):
        return None
    return [-math.log(max(float(p.step_time_s), 1e-12)) for p in predictions]
