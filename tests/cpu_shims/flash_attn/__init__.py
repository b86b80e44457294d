"""A CPU stand-in for the parts of flash-attention (a CUDA package) that verl 0.8's padding helpers import.

verl 0.8 (``verl.utils.attention_utils``) takes ``flash_attn.bert_padding``'s index helpers for
``left_right_2_no_padding`` on any non-NPU machine. They are plain torch index operations; transformers ships the
same ones for its own flash-attention path, and this package hands those on (its own ``index_first_axis``:
see ``bert_padding``). scripts/test_releases.sh puts this
folder on ``PYTHONPATH`` only for verl releases that import ``flash_attn``; nothing else sees it.
"""
