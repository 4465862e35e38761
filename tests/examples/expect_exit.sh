#!/usr/bin/env bash
# expect_exit.sh CODE PATTERN COMMAND...: COMMAND must exit with CODE and
# print PATTERN (grep -E) on stdout or stderr, and write nothing: when it
# names an output folder (--out DIR), a folder that did not exist must still
# not exist, and the files of one that did (an earlier run's) must be
# byte-identical afterwards. EXPECT_EXISTING_OUT=1: DIR must exist before.
set -uo pipefail
code=$1 pattern=$2
shift 2
outdir=""
args=("$@")
for ((i = 0; i < ${#args[@]}; ++i)); do
  case ${args[i]} in
    --out) outdir=${args[i + 1]:-} ;;
    --out=*) outdir=${args[i]#--out=} ;;
  esac
done
# (OUT/.lock, the run lock, names whichever run held it last: not output.)
snapshot() { (cd "$1" && find . -type f ! -path ./.lock -print0 | sort -z | xargs -0r sha256sum); }
before=""
existed=0
if [[ -n $outdir && -e $outdir ]]; then
  existed=1
  before=$(snapshot "$outdir")
fi
if [[ ${EXPECT_EXISTING_OUT:-0} == 1 && $existed == 0 ]]; then
  echo "the earlier run's folder $outdir does not exist (run its test first)"; exit 1
fi
out=$("$@" 2>&1)
rc=$?
echo "$out"
[[ $rc == "$code" ]] || { echo "exit code $rc, expected $code"; exit 1; }
grep -Eq -- "$pattern" <<<"$out" || { echo "output lacks /$pattern/"; exit 1; }
if [[ -n $outdir && ! $outdir == /proc/* ]]; then
  if ((existed)); then
    after=$(snapshot "$outdir")
    [[ "$before" == "$after" ]] ||
      { echo "the failed run changed $outdir:"; diff <(echo "$before") <(echo "$after"); exit 1; }
    echo "$outdir: $(wc -l <<<"$before") files unchanged"
  else
    [[ ! -e $outdir ]] || { echo "the failed run created $outdir"; find "$outdir" | head; exit 1; }
    echo "$outdir: not created"
  fi
fi
