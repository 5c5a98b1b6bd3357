"""Where a modelset's models come from: a local directory, the hub, the embedded SmolLM2-135M-Instruct
(``sources``), and the models mergeval builds itself, the tiny test model and fine-tuned domain experts
(``tiny``, ``experts``); ``resolve`` turns a modelset into checkpoint directories and fingerprints. Reading
and writing checkpoints is ``mergeval.models``', a layer below."""
