"""HuggingFace weights in and out of the reference runtime (spec §8).

The `weight_schema` of a `modulec build` document says where each parameter comes from in
a HuggingFace checkpoint (modulec.check.weights.hf_plan). With it:

    schema = doc["weight_schema"]
    weights = load_hf_weights(schema, "ckpt/")   # {"blocks[0].attention.qkv_weight": ...}
    hf = export_hf_tensors(schema, weights)      # {"model.layers.0.self_attn.q_proj.weight": ...}
    hf_grads = export_hf_tensors(schema, grads, gradients=True, weights=weights)
    save_hf_weights(schema, weights, "out/", config=json.load(open("ckpt/config.json")))

Every user mistake (no checkpoint, missing or mis-shaped tensors, unused tensors, unknown
parameter paths) is one WeightLoadError listing all of it. Decisions: docs/decisions.md,
"HF weights in and out (issue 5)".
"""

from runtime.hf_weights.errors import WeightLoadError
from runtime.hf_weights.export import export_hf_tensors, save_hf_weights
from runtime.hf_weights.load import HFWeights, load_hf_weights

__all__ = ["HFWeights", "WeightLoadError", "export_hf_tensors", "load_hf_weights",
           "save_hf_weights"]
