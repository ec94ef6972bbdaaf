"""lm-evaluation-harness scores the project's own multiple-choice task through the server's completions
endpoint (its `local-completions` model: echo=true, logprobs=1, max_tokens=1) and through the library
directly (a small adapter over `model(input_ids)`); both give the same accuracy."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from test_server import NAME, serve, write_served_model

import tierlm

lm_eval = pytest.importorskip("lm_eval")
from lm_eval.api.model import TemplateLM  # noqa: E402
from lm_eval.tasks import TaskManager  # noqa: E402

TASK = Path(__file__).parent / "data" / "lm_eval"


class LibraryLM(TemplateLM):
    """Log likelihoods from the library's own logits: log-softmax of model(context + continuation)."""

    def __init__(self, model) -> None:
        super().__init__()
        self.model = model

    @property
    def eot_token_id(self) -> int:
        return self.model.tokenizer.eos_token_ids[0]

    def tok_encode(self, string: str, **kwargs) -> list[int]:
        return self.model.tokenizer.encode(string, add_special_tokens=False)

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs):
        out = []
        for _key, context, continuation in requests:
            ids = torch.tensor([context + continuation])
            logprobs = self.model(ids).float().log_softmax(-1)[0, len(context) - 1 : -1]
            target = torch.tensor(continuation)
            total = logprobs.gather(-1, target[:, None]).sum().item()
            out.append((total, bool((logprobs.argmax(-1) == target).all())))
        return out

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False):
        raise NotImplementedError

    def generate_until(self, requests, disable_tqdm: bool = False):
        raise NotImplementedError


@pytest.fixture(scope="module")
def task_dir(tmp_path_factory) -> Path:
    """The shipped task with its data file's path written out in full (datasets reads it from anywhere)."""
    folder = tmp_path_factory.mktemp("lm_eval_task")
    data = TASK / "tierlm_mc.jsonl"
    text = (TASK / "tierlm_mc.yaml").read_text().replace("test: tierlm_mc.jsonl", f"test: {data}")
    (folder / "tierlm_mc.yaml").write_text(text)
    return folder


def accuracy(results: dict) -> float:
    return results["results"]["tierlm_mc"]["acc,none"]


def test_harness_accuracy_through_the_server_equals_the_library(tmp_path_factory, task_dir, monkeypatch):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    folder = write_served_model(tmp_path_factory.mktemp("served") / "tiny")
    model = tierlm.load(folder, dtype="float32")
    tasks = TaskManager(include_path=str(task_dir), include_defaults=False)
    direct = lm_eval.simple_evaluate(model=LibraryLM(model), tasks=["tierlm_mc"], task_manager=tasks)
    with serve(tierlm.load(folder, dtype="float32"), max_batch_size=8) as live:
        args = (
            f"model={NAME},base_url={live.url}/v1/completions,tokenizer={folder},tokenizer_backend=huggingface,"
            "tokenized_requests=True,num_concurrent=2,max_retries=1,batch_size=8"
        )
        served = lm_eval.simple_evaluate(
            model="local-completions", model_args=args, tasks=["tierlm_mc"], task_manager=tasks
        )
        requests = live.stats()["requests"]
    print(
        f"\ntierlm_mc acc: server (local-completions) {accuracy(served):.4f}, library {accuracy(direct):.4f}"
    )
    assert requests >= 32 * 4  # every choice of every item went through the server
    assert accuracy(served) == accuracy(direct)
    assert (
        served["results"]["tierlm_mc"]["acc_stderr,none"] == direct["results"]["tierlm_mc"]["acc_stderr,none"]
    )
