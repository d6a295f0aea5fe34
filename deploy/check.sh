#!/usr/bin/env bash
# Checks the deployment files, one line per file:
#   deploy/systemd/*.service      systemd-analyze verify (from the systemd package)
#   deploy/systemd/*.env.example  plain KEY=value lines, as systemd's EnvironmentFile= reads them
#   deploy/kubernetes/*.yaml      kubernetes-validate --strict against the oldest and the newest Kubernetes
#                                 these manifests are meant for; kustomization.yaml must list every one of them
# Usage: deploy/check.sh [KUBERNETES_VALIDATE]   (the kubernetes-validate command; default: the one on PATH)
# Exits non-zero when a file fails or a tool is missing.
set -euo pipefail

deploy=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
validate=${1:-kubernetes-validate}
# 1.30: the first release whose pods accept a preStop `sleep` without a feature gate (router.yaml).
kubernetes_versions=(1.30.0 1.37.0)
failures=0

ok() { printf 'ok   %s\n' "$1"; }
fail() {
  printf 'FAIL %s\n' "$1"
  printf '%s\n' "$2" | sed -e '/^$/d' -e 's/^/       /'
  failures=$((failures + 1))
}

tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

# --- systemd ---------------------------------------------------------------------------------------------------
if ! command -v systemd-analyze >/dev/null; then
  echo "*** NO systemd-analyze: the systemd units were NOT checked; install systemd (apt-get install systemd) ***"
  failures=$((failures + 1))
else
  # verify refuses a unit whose ExecStart= program does not exist, and the units name where llmgw is installed in
  # production (/opt/llmgw/bin/llmgw). So each unit is checked as a copy naming a stand-in script instead; nothing
  # else in it changes.
  printf '#!/bin/sh\nexit 0\n' >"$tmp/llmgw"
  chmod +x "$tmp/llmgw"
  for unit in "$deploy"/systemd/*.service; do
    name=$(basename "$unit")
    sed "s|/opt/llmgw/bin/llmgw|$tmp/llmgw|g" "$unit" >"$tmp/$name"
    # verify exits 0 on problems it only warns about (an unknown or misspelt key is ignored): any output fails.
    if out=$(cd "$tmp" && systemd-analyze verify --man=no "./$name" 2>&1) && [ -z "$out" ]; then
      ok "deploy/systemd/$name"
    else
      fail "deploy/systemd/$name" "${out:-systemd-analyze verify failed}"
    fi
  done
fi

for example in "$deploy"/systemd/*.env.example; do
  name=$(basename "$example")
  # EnvironmentFile= takes KEY=value lines, comments and blank lines; no `export`, no spaces around `=`.
  if out=$(grep -nvE '^(#.*|[A-Za-z_][A-Za-z0-9_]*=.*|)$' "$example"); then
    fail "deploy/systemd/$name" "not KEY=value:"$'\n'"$out"
  else
    ok "deploy/systemd/$name"
  fi
done

# --- Kubernetes ------------------------------------------------------------------------------------------------
kustomization="$deploy/kubernetes/kustomization.yaml"
# The `resources:` list of kustomization.yaml: its "  - FILE" lines up to the next top-level key.
listed=$(sed -n '/^resources:$/,/^[a-z]/s/^  - //p' "$kustomization")

if ! command -v "$validate" >/dev/null; then
  echo "*** NO kubernetes-validate ($validate): the Kubernetes manifests were NOT checked;"
  echo "*** install it with pip install -r requirements-dev.txt and pass its path: deploy/check.sh PATH ***"
  failures=$((failures + 1))
else
  for manifest in "$deploy"/kubernetes/*.yaml; do
    name=$(basename "$manifest")
    # kustomize's own file is no Kubernetes resource: no schema to check it against (checked below).
    if [ "$name" = kustomization.yaml ]; then
      continue
    fi
    problems=""
    for version in "${kubernetes_versions[@]}"; do
      # --quiet prints only warnings and failures. A warning fails too: a kind or apiVersion that has no schema
      # (a typo, a removed API) is only a warning to kubernetes-validate.
      if ! out=$("$validate" --strict --quiet --kubernetes-version "$version" "$manifest" 2>&1); then
        problems+="${out:-kubernetes-validate failed against $version}"$'\n'
      elif [ -n "$out" ]; then
        problems+="$out"$'\n'
      fi
    done
    if ! grep -qxF "$name" <<<"$listed"; then
      problems+="not listed under resources: in kustomization.yaml"$'\n'
    fi
    if [ -z "$problems" ]; then
      ok "deploy/kubernetes/$name"
    else
      fail "deploy/kubernetes/$name" "$problems"
    fi
  done
fi

missing=""
while IFS= read -r resource; do
  if [ -n "$resource" ] && [ ! -f "$deploy/kubernetes/$resource" ]; then
    missing+="lists $resource, which does not exist"$'\n'
  fi
done <<<"$listed"
if [ -z "$listed" ]; then
  fail "deploy/kubernetes/kustomization.yaml" "no resources: list found"
elif [ -n "$missing" ]; then
  fail "deploy/kubernetes/kustomization.yaml" "$missing"
else
  ok "deploy/kubernetes/kustomization.yaml"
fi

if [ "$failures" -gt 0 ]; then
  echo "deploy/check.sh: $failures failure(s)"
  exit 1
fi
