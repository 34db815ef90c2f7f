#!/bin/bash
# A fresh venv (python 3.11.7 ensurepip: setuptools 65.5.0, no `wheel`) cannot build the package
# with the README's user command; the error is a bare "invalid command 'bdist_wheel'".
set -x
rm -rf /tmp/probeQ/venv01 && python3 -m venv --system-site-packages /tmp/probeQ/venv01
cd /tmp/probeQ/repo
/tmp/probeQ/venv01/bin/pip install --no-build-isolation . 2>&1 | grep -E "bdist_wheel|error" 
/tmp/probeQ/venv01/bin/pip wheel --no-build-isolation --no-deps -w /tmp/probeQ/dist01 . 2>&1 | grep -E "bdist_wheel|error"
