"""Training workloads: synthetic data, small models and a DDP loop with mlfabric's comm hook.

    .venv/bin/python -c "from mlfabric.train import *; print(run_training(TrainConfig(steps=50), world_size=2).summary())"
"""

from .data import DataConfig, Dataset, make_dataset, shard
from .ddp import BASELINE, RankTrainResult, TrainConfig, TrainResult, run_training, train_rank
from .models import MLP, LeNet5, count_parameters

__all__ = [
    "BASELINE", "LeNet5", "MLP", "DataConfig", "Dataset", "RankTrainResult", "TrainConfig", "TrainResult",
    "count_parameters", "make_dataset", "run_training", "shard", "train_rank",
]
