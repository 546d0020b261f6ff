"""The reference model as one component: frozen copy, shared layers, quantised, precomputed/cached log-probs,
PEFT-adapter-disabled, periodic sync; a separately loaded model's (a teacher's) vocabulary checked against the
policy's (``check_same_vocabulary``)."""
from lightalign.modules.reference.model import create_reference_model

__all__ = ["create_reference_model"]
