#!/usr/bin/env bash
# Copies the header-only / static build dependencies that a lent GPU machine may lack
# (nlohmann-json, GoogleTest) into .deps/, which the device run carries with the tree.
set -euo pipefail
cd "$(dirname "$0")/.."
rm -rf .deps && mkdir -p .deps/include .deps/lib
cp -r /usr/include/nlohmann .deps/include/
cp -r /usr/include/gtest .deps/include/
cp /usr/lib/x86_64-linux-gnu/libgtest.a /usr/lib/x86_64-linux-gnu/libgtest_main.a .deps/lib/
du -sh .deps
