"""Debug sessions over the training loops people use: ``lowprec.integrations.hf`` (Hugging Face ``Trainer``),
``.lightning`` (Lightning) and ``.accelerate`` (a loop on accelerate), each imported on its own, as each imports its
library; ``.session`` holds what they share. Importing ``lowprec`` imports none of them."""
