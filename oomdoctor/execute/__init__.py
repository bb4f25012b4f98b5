"""The executor: builds the model a plan describes (meta/fake or real weights; real or stand-in bitsandbytes),
makes its optimizer and runs its steps. Every engine and ``train`` call it, so what is priced is what runs."""
