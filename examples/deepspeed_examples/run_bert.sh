#!/usr/bin/env bash
# DeepSpeedExamples' training/HelloDeepSpeed/train_bert_ds.py under zerospeed, with only the import renamed.
#   pip install fire loguru pytz sh      # the example's own requirements
#   examples/deepspeed_examples/run_bert.sh DEEPSPEEDEXAMPLES_DIR [script args...]
# What this machine forces: CPU, an offline `datasets` stand-in (zerospeed's bundled corpus instead of the
# WikiText download) and a tokenizer trained locally instead of downloading roberta-base.
set -euo pipefail
SRC="$1/training/HelloDeepSpeed/train_bert_ds.py"; shift
HERE="$(cd "$(dirname "$0")" && pwd)"
WORK="$(mktemp -d)"
sed -e 's/^import deepspeed\(\r\?\)$/import zerospeed as deepspeed\1/' -e 's/^from deepspeed\./from zerospeed./' "$SRC" > "$WORK/train_bert_zerospeed.py"
diff "$SRC" "$WORK/train_bert_zerospeed.py" || true  # the whole change
python "$HERE/make_tokenizer.py" "$WORK/tokenizer"
cd "$WORK"
PYTHONPATH="$HERE/offline_bert${PYTHONPATH:+:$PYTHONPATH}" zerospeed launch --nproc-per-node 2 train_bert_zerospeed.py \
  --checkpoint_dir "$WORK/ckpt" --tokenizer "$WORK/tokenizer" "$@"
