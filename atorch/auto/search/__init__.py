"""The strategy planner: a search space, a HEBO-driven search over it, and its report.

Pure and light: importing it loads neither hebo nor any training code; `auto_search` (the
entry `auto_accelerate` calls) connects it to the dry runner.
"""

from atorch.auto.search.search import DryRunResult, SearchResult, search_strategy
from atorch.auto.search.space import Candidate, SearchSpace

__all__ = ["Candidate", "DryRunResult", "SearchResult", "SearchSpace", "search_strategy"]
