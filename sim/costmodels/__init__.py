"""Step-latency cost models: `load_cost_model({type: ...}, model)` -> CostModel."""
from cbsim.sim.costmodels.registry import COST_MODELS, load_cost_model, register_cost_model

__all__ = ["COST_MODELS", "load_cost_model", "register_cost_model"]
