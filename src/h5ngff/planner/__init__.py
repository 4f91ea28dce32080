"""The pure planner: numbers in, a frozen Plan out. No h5py, zarr or dask here."""

from .memory import DEFAULT_CONSTANTS, MemoryConstants
from .model import Capacity, DatasetInfo, Level, MemoryTerm, Pass, Plan, Thresholds, WorkerMemory
from .plan import make_plan

__all__ = [
    "Capacity",
    "DEFAULT_CONSTANTS",
    "DatasetInfo",
    "Level",
    "MemoryConstants",
    "MemoryTerm",
    "Pass",
    "Plan",
    "Thresholds",
    "WorkerMemory",
    "make_plan",
]
