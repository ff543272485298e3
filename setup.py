from setuptools import find_packages, setup

setup(
    name="commbench",
    version="0.1.0",
    description="Collective-communication microbenchmarks and step-time prediction for distributed training",
    packages=find_packages(include=["commbench", "commbench.*"]),
    package_data={"commbench": ["systems/*.json"]},
    python_requires=">=3.9",
    # GPU clusters bring their own torch (a CUDA build): a range, never a pin.
    install_requires=[
        "torch>=2.1",
        "numpy>=1.23",
        "scipy>=1.10",
        "pandas>=1.5",
        "rich>=13",
        "pyyaml>=6",
    ],
    extras_require={
        # mpi4py builds against the cluster's own MPI (Cray MPICH, Open MPI, HPC-X)
        "mpi": ["mpi4py>=3.1"],
        # the mpich wheel: an MPI for machines that have none (laptop, CI)
        "mpich": ["mpi4py>=3.1", "mpich"],
        "gpu": ["cupy-cuda12x", "nvidia-ml-py"],
        "plot": ["matplotlib>=3.6"],
        "test": ["pytest>=7", "pytest-timeout", "hypothesis"],
        "all": ["mpi4py>=3.1", "cupy-cuda12x", "nvidia-ml-py", "matplotlib>=3.6",
                "pytest>=7", "pytest-timeout", "hypothesis"],
    },
    entry_points={"console_scripts": ["commbench=commbench.cli:entry"]},
)
