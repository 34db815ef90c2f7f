"""Integrations with training frameworks, each an optional extra:

    zero_kernels.integrations.lightning   PyTorch Lightning strategies "zk_zero1/2/3"  (pip install 'zero_kernels[lightning]')
    zero_kernels.integrations.hf          Hugging Face Trainer helper and save_pretrained under ZeRO-3  ('zero_kernels[hf]')

Import the one you use; nothing here is imported by ``import zero_kernels``.
"""
