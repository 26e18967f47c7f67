"""estimator_towers: data-parallel training of TensorFlow Estimators on several devices."""

import setuptools

setuptools.setup(
    name='estimator_towers',
    version='0.1.0',
    description=('Data-parallel (towered) training of tf.estimator model_fns on '
                 'several GPUs or CPU devices with one decorator.'),
    long_description=open('README.md', encoding='utf-8').read(),
    long_description_content_type='text/markdown',
    license='Apache-2.0',
    # Every subpackage (the stages and the self-test); not tests/, examples/, bench/.
    packages=setuptools.find_packages(include=['estimator_towers', 'estimator_towers.*']),
    python_requires='>=3.9,<3.12',
    install_requires=[
        'tensorflow==2.15.1',
        'tensorflow-estimator==2.15.0',
        'numpy<2',
        'absl-py>=1.0',
    ],
    extras_require={
        # GPU users: pip install 'estimator_towers[gpu]' (tensorflow-gpu is gone from PyPI).
        'gpu': ['tensorflow[and-cuda]==2.15.1'],
        # bert-tensorflow: google-research BERT's pre-training model_fn (tests/test_bert.py);
        # tf-slim serves the tensorflow.contrib.layers it imports (tests/bert_model.py).
        # build: .ci/run's wheel and sdist (python -m build).
        'test': ['pytest>=7', 'pytest-timeout>=2', 'pytest-xdist>=3', 'hypothesis>=6',
                 'bert-tensorflow==1.0.4', 'tf-slim==1.1.0', 'build>=1'],
        # bench/towers_bench.py's plot: pip install -e '.[bench]'
        'bench': ['matplotlib>=3.5'],
        # The docs site (mkdocs.yml): pip install -e '.[docs]' && mkdocs serve.
        # mkdocstrings reads the docstrings statically (griffe); ruff formats
        # the signatures. Pinned (versions that install on Python 3.9-3.11):
        # .ci/run builds the site with --strict.
        'docs': [
            'mkdocs==1.6.1',
            'mkdocs-material==9.6.14',
            'mkdocstrings==0.29.1',
            'mkdocstrings-python==1.16.12',
            'mkdocs-autorefs==1.4.2',
            'griffe==1.7.3',
            'pymdown-extensions==10.15',
            'Markdown==3.8',
            'ruff==0.17.6',
        ],
    },
    classifiers=[
        'Programming Language :: Python :: 3.9',
        'Programming Language :: Python :: 3.10',
        'Programming Language :: Python :: 3.11',
        'License :: OSI Approved :: Apache Software License',
    ],
)
