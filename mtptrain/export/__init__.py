"""Heads in the formats serving engines load, and back.

    run.py          `mtptrain export`: run_export, export_head
    formats/        one module per format: its tensor names, config and limits (FORMATS, read_export)
    source.py       what an export reads: a trained head (or an export of one) and its target
    sidecar.py      what an export directory holds, and its mtptrain.json sidecar
    conformance.py  the check of an export against its format's table in specs/
    readme.py       the README written into an export
    stitch.py       `mtptrain stitch`: MTP layers into a copy of the target checkpoint
"""
