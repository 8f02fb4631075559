"""atorch: automatic acceleration of PyTorch and Hugging Face training."""

from pathlib import Path

from setuptools import find_packages, setup

HERE = Path(__file__).parent


def read_requirements(name: str):
    return [line.strip() for line in (HERE / name).read_text().splitlines()
            if line.strip() and not line.startswith("#")]


setup(
    name="atorch",
    version="0.1.0",
    description="Automatic distributed-training acceleration for PyTorch and Hugging Face models",
    long_description=(HERE / "README.md").read_text(encoding="utf-8"),
    long_description_content_type="text/markdown",
    python_requires=">=3.9",
    packages=find_packages(include=["atorch", "atorch.*"]),
    package_data={"atorch.data": ["assets/corpus.txt", "assets/tokenizer/*"]},
    include_package_data=True,
    install_requires=read_requirements("requirements.txt"),
    entry_points={"console_scripts": ["atorch = atorch.cli:main"]},
    extras_require={"test": ["pytest>=7", "pytest-timeout>=2.1", "pytest-xdist>=3.5", "mypy>=1.10",
                             "tensorboard>=2.14"],
                    "tensorboard": ["tensorboard>=2.14"]},
)
