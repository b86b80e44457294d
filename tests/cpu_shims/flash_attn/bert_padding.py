"""``flash_attn.bert_padding``'s index helpers in torch (see the package).

``index_first_axis`` is flash-attention's: rows ``indices`` of the first axis of a tensor whose batch and sequence
axes the caller has already flattened, every other axis kept. transformers' ``_index_first_axis`` flattens the
first two axes once more, which for a (tokens, layers, top-k, 1) input such as verl's routed experts indexes
(tokens x layers) rows instead, so it is not handed on; ``pad_input`` and ``unpad_input`` are the same in both.
"""

import torch
from einops import rearrange
from transformers.modeling_flash_attention_utils import _pad_input as pad_input
from transformers.modeling_flash_attention_utils import _unpad_input as unpad_input


def index_first_axis(tensor: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    """``(len(indices), *tensor.shape[1:])``: the rows ``indices`` of ``tensor``'s first axis."""
    return tensor[indices]


__all__ = ["index_first_axis", "pad_input", "rearrange", "unpad_input"]
