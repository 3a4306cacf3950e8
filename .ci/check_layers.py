#!/usr/bin/env python3
"""Fails on an #include in include/linattn that breaks the module layering.

The layers come from the block between the `layers:begin` and `layers:end` markers of
docs/ARCHITECTURE.md, one layer per line, lowest first; modules of one layer are peers.
A header may include: a header of its own module; a public header of a module in a lower
layer; its own module's detail/, or core/detail/ (the shared toolbox). Anything else (a higher
layer, a peer, another module's detail/, a cycle) is reported with the file and line.
Headers directly under include/linattn/ (the module headers and forwarding headers) sit above
every module and may include any public header, never a detail/ one.
Usage: check_layers.py [repo root]   (exit status 1 on a violation)
"""
import os
import re
import sys

ROOT = os.path.abspath(sys.argv[1] if len(sys.argv) > 1 else
                       os.path.join(os.path.dirname(__file__), '..'))
INCLUDE = os.path.join(ROOT, 'include', 'linattn')
SHARED_DETAIL = 'core'
INCLUDE_RE = re.compile(r'^\s*#\s*include\s*([<"])([^>"]+)[>"]')


def read_layers():
    path = os.path.join(ROOT, 'docs', 'ARCHITECTURE.md')
    layers, inside = {}, False
    with open(path, encoding='utf-8') as f:
        for line in f:
            if 'layers:begin' in line:
                inside = True
            elif 'layers:end' in line:
                inside = False
            elif inside and line.strip() and not line.startswith('```'):
                level = len(set(layers.values()))
                for module in line.split('|')[0].split():
                    layers[module] = level
    if not layers:
        sys.exit(f'check_layers: no layer block (layers:begin ... layers:end) in {path}')
    return layers


def module_of(rel):
    """('gated', False) for gated/x.hpp, ('gated', True) for gated/detail/x.hpp, (None, ..) top."""
    parts = rel.split('/')
    if len(parts) == 1:
        return None, False
    return parts[0], len(parts) > 2 and parts[1] == 'detail'


def resolve(src_rel, quote, target):
    if quote == '<':
        if not target.startswith('linattn/'):
            return None
        return target[len('linattn/'):]
    path = os.path.normpath(os.path.join(os.path.dirname(src_rel), target))
    return None if path.startswith('..') else path


def main():
    layers = read_layers()
    errors, edges = [], {}
    for dirpath, _, files in os.walk(INCLUDE):
        for name in sorted(files):
            if not name.endswith('.hpp'):
                continue
            rel = os.path.relpath(os.path.join(dirpath, name), INCLUDE).replace(os.sep, '/')
            mod, _ = module_of(rel)
            if mod is not None and mod not in layers:
                errors.append(f'include/linattn/{rel}: module "{mod}" is not in the layers of '
                              'docs/ARCHITECTURE.md')
                continue
            with open(os.path.join(dirpath, name), encoding='utf-8') as f:
                for lineno, line in enumerate(f, 1):
                    m = INCLUDE_RE.match(line)
                    if not m:
                        continue
                    tgt = resolve(rel, m.group(1), m.group(2))
                    if tgt is None:
                        continue
                    where = f'include/linattn/{rel}:{lineno}: includes {m.group(2)}'
                    if not os.path.isfile(os.path.join(INCLUDE, tgt)):
                        errors.append(f'{where}: no such header')
                        continue
                    edges.setdefault(rel, []).append((tgt, lineno))
                    tmod, tdetail = module_of(tgt)
                    if tmod is None:
                        if mod is not None:
                            errors.append(f'{where}: a module header includes a top-level header')
                        continue
                    if tdetail and mod is None:
                        errors.append(f'{where}: a top-level header includes a detail/ header')
                    elif tdetail and tmod != mod and tmod != SHARED_DETAIL:
                        errors.append(f'{where}: the detail/ of module "{tmod}" is private to it')
                    elif mod is not None and tmod != mod:
                        if layers[tmod] > layers[mod]:
                            errors.append(f'{where}: "{mod}" (layer {layers[mod]}) may not include '
                                          f'the higher "{tmod}" (layer {layers[tmod]})')
                        elif layers[tmod] == layers[mod]:
                            errors.append(f'{where}: "{mod}" and "{tmod}" are peers of one layer')
    # Cycles among headers (a cycle inside one module passes the layer test above).
    state = {}

    def visit(node, stack):
        state[node] = 1
        for tgt, lineno in edges.get(node, []):
            if state.get(tgt) == 1:
                cycle = stack[stack.index(tgt):] + [tgt] if tgt in stack else [node, tgt]
                errors.append(f'include/linattn/{node}:{lineno}: include cycle: ' +
                              ' -> '.join(cycle))
            elif tgt not in state:
                visit(tgt, stack + [tgt])
        state[node] = 2

    for node in sorted(edges):
        if node not in state:
            visit(node, [node])
    for e in errors:
        print(e)
    if errors:
        print(f'check_layers: {len(errors)} violation(s); the layers are in docs/ARCHITECTURE.md')
        return 1
    print(f'check_layers: {len(edges)} headers, layering holds')
    return 0


if __name__ == '__main__':
    sys.exit(main())
