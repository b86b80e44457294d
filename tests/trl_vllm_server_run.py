"""Subprocess for tests/test_integration_trl.py: a TRL GRPOTrainer in server mode (``use_vllm=True,
vllm_mode="server"``) against a running ``trl vllm-serve``, with attach(topk=4), in a process of its own.

Usage: python tests/trl_vllm_server_run.py MODEL_DIR WORKDIR BASE_URL. Writes the run to WORKDIR/logs/server, TRL's
``state.log_history`` to WORKDIR/log_history.json and what the weight sync did to WORKDIR/sync.json.

Weight sync on CPU. TRL 1.16's server mode opens its weight-update group with ``VLLMClient.init_communicator``,
which runs on vLLM's NCCL weight-transfer engine and refuses a non-CUDA device before any rendezvous
(``NotImplementedError: Weight synchronization runs on vLLM's NCCL weight-transfer engine, which needs a CUDA device,
got 'cpu'``). Here TRL's own call is made and its refusal recorded; ``sync_weights`` then takes another route, the
one vLLM offers a CPU server: the trainer's parameters (TRL's own ``_iter_named_params``, under vLLM's names) go to a
safetensors file that the server's worker loads through its ``/collective_rpc`` endpoint
(tests/vllm_server_cpu/weight_file_sync.py), followed by TRL's own ``reset_prefix_cache``. Everything else
(generation, log-probs, top-K) is TRL's server path unchanged.
"""

import json
import os
import sys

from safetensors.torch import save_file
from trl_grpo_script import attached_trainer, train


def main() -> None:
    from trl.generation.vllm_client import VLLMClient
    from trl.generation.vllm_generation import VLLMGeneration

    model_dir, work, base_url = sys.argv[1], sys.argv[2], sys.argv[3]
    record: dict = {"refusal": None, "syncs": [], "tensors": []}
    trainer = None  # set below; the sync records TRL's step
    init_communicator = VLLMClient.init_communicator

    def init_communicator_on_cpu(self, device=0):
        try:
            init_communicator(self, device=device)
        except NotImplementedError as err:  # TRL's own refusal of a CPU trainer, kept for the test to read
            record["refusal"] = f"{type(err).__name__}: {err}"

    def sync_weights_through_a_file(self):
        path = os.path.join(work, "weights.safetensors")
        save_file({name: param.detach().contiguous() for name, param in self._iter_named_params()}, path)
        answer = self.vllm_client._post(f"{self.vllm_client.base_url}/collective_rpc",
                                        json={"method": "load_weights_file", "args": [path]})
        self.vllm_client.reset_prefix_cache()
        record["syncs"].append(trainer.state.global_step)
        record["tensors"].append(answer["results"])

    VLLMClient.init_communicator = init_communicator_on_cpu
    VLLMGeneration.sync_weights = sync_weights_through_a_file

    trainer = attached_trainer(model_dir, work, "server", vllm_mode="server", vllm_server_base_url=base_url,
                               vllm_server_timeout=600)
    train(trainer, work)
    with open(os.path.join(work, "sync.json"), "w") as f:
        json.dump(record, f)


if __name__ == "__main__":
    main()
