"""What bench/decoder_cpu.py and bench/seq2seq_cpu.py share: engines in worker processes driven by JSON lines,
the Optimum virtual environment, the CPU watch, statistics, ratios and goals, and the report.

- `worker`: the worker process side (runs inside the Optimum venv too: standard library only at import time);
- `inputs`: the inputs every engine gets (seeded random token ids or pixels), made once, read in each worker;
- `engines`: the main side of the workers, the Optimum venv and the weights folder every engine loads;
- `stats`: CPU watch, per-round statistics, token agreement, ratios and goals;
- `render`: the tables and the report text;
- `driver`: the whole run (warm-up, interleaved rounds, memory, report) and the scripts' `main`;
- `bench`: `Bench`, what a script tells the harness about itself, and `Family`, what a model family changes in it;
- `encoders`, `encoder_report`: what bench/encoder_cpu.py adds (a sentence-transformers model, convert_model's
  graphs, real-text inputs, runners timing one embedding call; fidelity, goals and the report of its own).

Nothing here imports nndf, torch or transformers at import time.
"""
