"""The torch integrations: autograd functions, nn layers, gradient sync, custom ops
for torch.compile, the torch.distributed backend and DistDL's names.

Each module imports torch; `import fastreduce` does not, so the core works without it.
"""
