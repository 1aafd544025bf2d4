"""The pieces of the training job that ``run_pretrain.py`` strings together, one concept per module.

run          the job once its command line is read: preflight, the ranks (here or a launcher's), the loop
args         command line -> ``TrainArgs`` (the ds_config with its overrides applied, the layout of --mode)
flags        run_pretrain.py's flags, as --help groups them (torch-free: --help answers at once)
settings     what the flags derive from the ds_config: the layout of --mode, the ds_config with the overrides
checks       values refused before any rank starts, each naming the flag or key to change
resources    host memory and disk space the run needs, from the planner's training state
evaluation   the evaluation loss on held-out batches
modes        disaggregated or co-located: preflight, banner lines, build of one mode (a ``RankRuntime``)
plan         the job's plan: what the preflight derived once (settings, config, layout, resume point), read by the ranks
hostfile     DeepSpeed hostfile validation, and re-launching ``run_pretrain.py`` through ``deepspeed``
data         tokenizer, packed pretraining or SFT samples, and each lane's resumable loader
model        the HF model to train: fresh, or ``--init-from`` pretrained weights; freezing parts of it
balance      per-layer expert load, its imbalance, and DeepSeek-V3 auxiliary-loss-free bias updates
metrics      model FLOPs (Megatron counting), MFU, one record per step
progress     rank 0's output: start banner, progress bar or log lines, JSON lines, TensorBoard
checkpoints  periodic/final saves with every lane's loader state, freezing, seed and tokenizer; keep-last-N; resume
             checks (files, layout, ZeRO stage, seed, freezing)
export       --export-hf: the job's weights and tokenizer as a save_pretrained directory, written from inside the job
interrupt    Ctrl-C / SIGTERM / a lost launcher: every rank agrees to stop after the current step, then saves
failures     ranks that failed: one line naming the root cause, every traceback in a log file

disagmoe-convert's work on the checkpoints these write (``disagmoe_ds.convert`` is its command line):

conversion_jobs  the job of a layout, and a checkpoint opened (and checked) with the job that wrote it
conversion       HF -> checkpoint, checkpoint -> HF, and re-layout, each run on a layout's CPU ranks
"""
