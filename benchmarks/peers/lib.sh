# Shared by the peers' setup scripts (sourced, after PY is set to the peer venv's python).

# pip with this machine's noise filtered (a find-links/extra-index entry per package that has no local copy).
pip_q() { "$PY" -m pip "$@" 2> >(grep -v "is ignored: it is neither a file nor a directory" >&2); }

# find_python MINOR: the first of $PYTHON, python3.12, python3.13, pyenv's 3.12 and python3 that is
# Python >= 3.MINOR; fails if none is.
find_python() {
  local c
  for c in ${PYTHON:-} python3.12 python3.13 "${PYENV_ROOT:-$HOME/.pyenv}"/versions/3.12*/bin/python3 python3; do
    [ -n "$c" ] && "$c" -c "import sys; sys.exit(0 if sys.version_info >= (3, $1) else 1)" 2>/dev/null && { echo "$c"; return 0; }
  done
  return 1
}
