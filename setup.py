from setuptools import setup

setup(
    name="mfd-sglang",
    version="0.1.0",
    description="Multi-Future Drafting speculative decoding as an SGLang plugin",
    python_requires=">=3.10",
    packages=["mfd_sglang", "mfd_sglang.check", "mfd_sglang.cpu", "mfd_sglang.lab", "mfd_sglang.lab.multimodal",
              "mfd_sglang.serving", "mfd_sglang.serving.budget",
              "mfd_sglang.serving.launch", "mfd_sglang.kernels", "mfd_sglang.patches"],
    # The pure-torch `sgl_kernel` stand-in: put on sys.path by mfd_sglang.cpu, never installed as `sgl_kernel`.
    # The one GPU log the cost ledger's launch floor is fitted to (python -m mfd_sglang gpu-ledger).
    package_data={"mfd_sglang": ["data/*.log"],
                  "mfd_sglang.cpu": ["sgl_kernel_standin/README.md", "sgl_kernel_standin/sgl_kernel/*.py"]},
    # kernels/ and patches/ live at the repository root but install INSIDE mfd_sglang: a top-level
    # `kernels` package would shadow the PyPI `kernels` package that sglang depends on.
    package_dir={"mfd_sglang": "mfd_sglang", "mfd_sglang.kernels": "kernels", "mfd_sglang.patches": "patches"},
    install_requires=[
        "torch==2.14.1",
        "transformers==5.19.0",
        "sglang==0.5.23",
        "safetensors",
        "tokenizers",
    ],
    entry_points={
        "console_scripts": ["mfd-sglang=mfd_sglang.cli:main"],
        "sglang.srt.plugins": ["mfd_sglang=mfd_sglang.plugin:register"],
    },
)
