#!/usr/bin/env bash
# The browser test (tests/test_browser.py) drives Debian's chromium through playwright. `make test` calls this:
# chromium is installed when it is missing and we are root on a Debian-like machine (CI is); elsewhere that test
# is skipped and says how to install it. COURSE_NO_BROWSER=1 skips this step. `make lab` never installs it.
set -euo pipefail
if [ "${COURSE_NO_BROWSER:-0}" != 1 ] && ! command -v chromium >/dev/null 2>&1 \
    && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
  echo "setup: installing Debian's chromium for the browser test (COURSE_NO_BROWSER=1 skips this)"
  t0=$(date +%s)
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends chromium >/dev/null
  echo "setup: chromium installed in $(( $(date +%s) - t0 )) s"
fi
