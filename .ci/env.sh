# Shared by .ci/run, .ci/lock and .ci/latest (sourced, from the repository root): every run builds
# fresh virtual environments of its own, so what the machine already has never hides a dependency
# release that breaks a newcomer.
export PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_ROOT_USER_ACTION=ignore PIP_PROGRESS_BAR=off

# fresh_venv DIR: a new virtual environment at DIR (removed first), activated, with current pip.
fresh_venv() {
    rm -rf "$1"
    python3 -m venv "$1"
    # shellcheck disable=SC1091
    . "$1/bin/activate"
    python -m pip install -q -U pip
}

# readme_command MARKER: the first indented `pip install ...` line after the README line that
# holds MARKER, so CI runs the README's commands word for word.
readme_command() {
    awk -v m="$1" 'found && /^    pip install / {sub(/^    /, ""); print; exit} index($0, m) {found = 1}' README.md
}

# show_versions: what the active environment holds, for the log (and the stop's note).
show_versions() {
    echo "== $(command -v python): $(python --version 2>&1), $(python -m pip freeze | grep -vc '^-e') packages"
    python -m pip freeze | grep -iE '^(torch|torchao|torchdata|transformers|kernels|peft|liger|deepspeed|vllm|accelerate|safetensors|huggingface)' | tr '\n' ' '
    echo
}

# write_lock FILE: the active environment's versions as a pip constraints file (lightrft itself
# and local build labels such as +cpu left out: `torch==2.13.0` takes the CPU or CUDA build).
write_lock() {
    {
        echo "# pip constraints: every version the suite was last green with (regenerate: .ci/lock $2)."
        echo "# Made $(date -u +%Y-%m-%d) with $(python --version 2>&1) on $(uname -m) Linux."
        python -m pip freeze --exclude-editable | grep -v -E '^(lightrft|-e )' | sed -E 's/\+[a-z0-9.]+$//' | LC_ALL=C sort -f
    } > "$1"
}
