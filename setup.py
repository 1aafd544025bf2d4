"""DisagMoE-DS: disaggregated attention/expert MoE training on DeepSpeed."""

from setuptools import find_packages, setup

setup(
    name="disagmoe_ds",
    version="0.1.0",
    description="Disaggregated attention/expert (AF-Pipe) Mixture-of-Experts training on DeepSpeed",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    packages=find_packages(include=["disagmoe_ds", "disagmoe_ds.*"]),
    package_data={"disagmoe_ds": ["data/corpus/*", "py.typed"]},
    python_requires=">=3.10",
    install_requires=[
        # torch is deliberately unpinned here: CI pins the CPU build, GPU machines keep theirs.
        "torch>=2.6",
        "deepspeed==0.19.8",
        "transformers>=5.17,<6",
        "huggingface-hub>=1.5",
        "accelerate>=1.0",
        "datasets>=3.0",
        "sentencepiece>=0.2",
        "safetensors>=0.4",
        "tqdm>=4.60",
        "numpy>=1.24",
        "peft>=0.21",  # LoRA: disagmoe-verify --lora-rank checks against PEFT, --export-hf writes its adapter format
        "psutil>=5.9",  # train.interrupt: a rank notices its launcher is gone (deepspeed needs it too)
    ],
    extras_require={
        # triton: tests run its kernels in its interpreter on CPU machines (CUDA wheels of torch ship it already)
        "test": [
            "pytest>=8",
            "pytest-xdist>=3.5",  # the README's test command runs on 2 workers (-n 2)
            "ruff>=0.6",
            "mypy>=1.10",
            "triton>=3.2; platform_system == 'Linux'",
        ],
        "flash": ["flash-attn>=2.6"],
        "plot": ["matplotlib>=3.7"],
        "tensorboard": ["tensorboard>=2.14"],
    },
    entry_points={
        "console_scripts": [
            "disagmoe-verify = disagmoe_ds.afpipe.verify:main",
            "disagmoe-plan = disagmoe_ds.planner.cli:main",
            "disagmoe-convert = disagmoe_ds.convert:main",
        ],
    },
)
