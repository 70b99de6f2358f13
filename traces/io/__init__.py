"""Files: atomic replacement of files and directories, a recorder's crash-safe
parts, bounded YAML, the requests table read in batches. Imports
:mod:`traces.model`, never vLLM.
"""
