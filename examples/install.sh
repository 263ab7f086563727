# Sourced by examples/setup_vllm.sh, examples/setup_verl.sh and tests/run.sh, from the
# repository root, once .venv exists:
#   venv_install ARGS...    installs into .venv what `pip install ARGS...` would
#   venv_uninstall NAMES... removes packages from .venv (none of them installed is no error)
# Both go through uv, which pip puts into .venv on first use: uv resolves and unpacks the two
# hundred packages of vLLM, verl and their dependencies in seconds where pip takes minutes, and
# installs the same versions. uv reads no pip configuration, so the index, extra indexes,
# find-links and constraints that pip is configured with (files or PIP_* variables) are passed
# on. TRANSPORT_INSTALLER=pip installs with pip instead, as does a machine where uv cannot be had.

_pip() {
    .venv/bin/python -m pip -q --disable-pip-version-check "$@" 2>&1 \
        | grep -v -E "^WARNING: Location|^verl .* requires|^ERROR: pip's dependency resolver" || true
}

# The uv options that say what pip's configuration says (every scope; the environment's last).
_uv_options_from_pip() {
    local key value
    local -a options=()
    while IFS= read -r line; do
        key=${line#*.}
        key=${key%%=*}
        value=${line#*=}
        value=${value#\'}
        value=${value%\'}
        case "$key" in
        index-url) options+=(--index-url "$value") ;;
        extra-index-url) for v in $value; do options+=(--extra-index-url "$v"); done ;;
        find-links) for v in $value; do options+=(--find-links "$v"); done ;;
        constraint) for v in $value; do [ -f "$v" ] && options+=(--constraint "$v"); done ;;
        esac
    done < <(.venv/bin/python -m pip config list 2>/dev/null)
    [ ${#options[@]} -eq 0 ] || printf '%s\n' "${options[@]}"
}

_uv_ready() {
    [ "${TRANSPORT_INSTALLER:-uv}" = "uv" ] || return 1
    [ -x .venv/bin/uv ] && return 0
    _pip install uv
    [ -x .venv/bin/uv ]
}

venv_install() {
    if _uv_ready; then
        local -a options
        mapfile -t options < <(_uv_options_from_pip)
        # pip takes the best version that any index offers, and compiles what it installs (an
        # environment that writes no bytecode would otherwise compile vLLM at every import): so
        # does uv here, unless TRANSPORT_COMPILE_BYTECODE=0 (tests/run.sh: its processes write
        # the bytecode of what they import, under a third of what the installs hold)
        local -a compile=(--compile-bytecode)
        [ "${TRANSPORT_COMPILE_BYTECODE:-1}" = "0" ] && compile=()
        .venv/bin/uv pip install -q --python .venv/bin/python --index-strategy unsafe-best-match \
            "${compile[@]}" "${options[@]}" "$@"
    else
        _pip install "$@"
    fi
}

venv_uninstall() {
    if _uv_ready; then
        .venv/bin/uv pip uninstall -q --python .venv/bin/python "$@"
    else
        _pip uninstall -y "$@"
    fi
}
