# Sourced by the device scripts: moves to the repository root and unpacks whichever binaries
# dist*/ hold (xz) into /tmp/bin, where they stay while the machine is warm.
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
mkdir -p /tmp/bin
for f in dist*/*.xz; do
  [ -e "$f" ] && xz -T0 -dc "$f" > "/tmp/bin/$(basename "$f" .xz)" && chmod +x "/tmp/bin/$(basename "$f" .xz)"
done
