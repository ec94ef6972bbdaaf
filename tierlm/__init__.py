"""tierlm: decoder-only LLMs across memory tiers, compiled when placement allows."""

from tierlm.compile import CompileConfig, CompileSkippedWarning
from tierlm.config import ModelConfig
from tierlm.model import Model, load

__all__ = ["CompileConfig", "CompileSkippedWarning", "Model", "ModelConfig", "load"]
