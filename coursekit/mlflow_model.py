"""The MLflow model the kit registers: a Hugging Face causal LM directory behind MLflow's pyfunc
interface (prompts in, greedy completions out).

MLflow logs this file as code ("models from code"), and MLflow's own loaders (`mlflow.pyfunc.
load_model`, `mlflow models serve`) import the copy of it in the artifact store: whoever can
write to the store then runs code as you. The kit's `registry load` does not: it downloads the
model's files and reads them with `Completer` from the kit's own copy of this module, as
safetensors weights and JSON (no pickle, and no code from the model's directory).
"""
import mlflow
import torch


class Completer:
    """Greedy completions of prompts by the Hugging Face causal LM in ``model_dir``."""

    def __init__(self, model_dir):
        from transformers import AutoModelForCausalLM, AutoTokenizer
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir, trust_remote_code=False)
        self.model = AutoModelForCausalLM.from_pretrained(
            model_dir, use_safetensors=True, trust_remote_code=False).eval()

    def predict(self, prompts, params=None):
        """Each prompt's greedy continuation of ``max_new_tokens`` tokens (default 16)."""
        max_new_tokens = int((params or {}).get("max_new_tokens", 16))
        completions = []
        for prompt in prompts:
            ids = self.tokenizer(str(prompt), return_tensors="pt").input_ids
            with torch.no_grad():
                out = self.model.generate(ids, max_new_tokens=max_new_tokens, do_sample=False,
                                          pad_token_id=self.tokenizer.eos_token_id)
            completions.append(self.tokenizer.decode(out[0, ids.shape[1]:],
                                                     skip_special_tokens=True))
        return completions


class CausalLM(mlflow.pyfunc.PythonModel):
    """The same completions for MLflow's loaders and `mlflow models serve`."""

    def load_context(self, context):
        self.completer = Completer(context.artifacts["model"])

    def predict(self, context, model_input, params=None):
        prompts = model_input.iloc[:, 0] if hasattr(model_input, "iloc") else model_input
        return self.completer.predict(prompts, params)


mlflow.models.set_model(CausalLM())
