"""DisagMoE-DS: disaggregated attention/expert training of Mixture-of-Experts LLMs on DeepSpeed."""

__version__ = "0.1.0"
