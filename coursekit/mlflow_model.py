"""The MLflow model the kit registers: a Hugging Face causal LM directory behind MLflow's pyfunc
interface (prompts in, greedy completions out).

MLflow logs this file as code ("models from code"), so loading a registered model imports it
instead of unpickling an object. Importing is still running code: the copy of this file in the
artifact store is what runs, so load models only from a store that no one else can write.
"""
import mlflow
import torch


class CausalLM(mlflow.pyfunc.PythonModel):
    def load_context(self, context):
        from transformers import AutoModelForCausalLM, AutoTokenizer
        self.tokenizer = AutoTokenizer.from_pretrained(context.artifacts["model"])
        self.model = AutoModelForCausalLM.from_pretrained(context.artifacts["model"]).eval()

    def predict(self, context, model_input, params=None):
        """Each prompt's greedy continuation of ``max_new_tokens`` tokens (default 16)."""
        prompts = model_input.iloc[:, 0] if hasattr(model_input, "iloc") else model_input
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


mlflow.models.set_model(CausalLM())
