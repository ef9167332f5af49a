"""``geoshard simulate``'s model: predicts a training run from its options without running it. Data
flows config -> parts -> prediction: ``links`` (one TCP transfer over a WAN link), ``grad`` (DDP's
per-step gradient exchange), ``outer`` (a DiLoCo round on the store), ``p2p`` (one peer to peer, by
its phases), ``loader`` (first batch, IO wait, bytes per tier), ``cost`` (egress), composed by
``predict`` into one ``Prediction``. Every part is a closed form per region or region pair
(docs/simulate.md), so its cost does not grow with samples or steps.
"""

from geoshard.sim.config import Constants, LinkSpec, RegionSpec, SimConfig
from geoshard.sim.predict import Prediction, RegionPrediction, predict

__all__ = ["Constants", "LinkSpec", "Prediction", "RegionPrediction", "RegionSpec", "SimConfig", "predict"]
