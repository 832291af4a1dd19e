"""The tiny demo model behind `kubeinfer demo-model`; `kubeinfer.dev.demo_model` is its public face.

  * recipe   - the constants, the recipe that decides the weights, and the error type;
  * corpus   - the training texts, the tokenizer trained on them, and the sampling of training windows;
  * training - base-model and LoRA-adapter training, saved in Hugging Face and PEFT layouts;
  * build    - the idempotent build into OUT with its manifest, and greedy samples of a build;
  * cli      - `kubeinfer demo-model OUT`.
"""
