"""``flash_attn.bert_padding``'s index helpers, as transformers implements them in torch (see the package)."""

from einops import rearrange
from transformers.modeling_flash_attention_utils import _index_first_axis as index_first_axis
from transformers.modeling_flash_attention_utils import _pad_input as pad_input
from transformers.modeling_flash_attention_utils import _unpad_input as unpad_input

__all__ = ["index_first_axis", "pad_input", "rearrange", "unpad_input"]
